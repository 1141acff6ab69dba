"""experiments.backends.verl.search_agent: the Search-R1 agent loop against a scripted verl server.

The loop is built as verl's AgentLoopWorker builds it (the agent_loops.yaml entry through
hydra.utils.instantiate), with the local character-level tokenizer, a fake ``server_manager``
whose ``generate`` returns scripted ``TokenOutput``s, and a fake retriever (one test uses the real
`emapg retriever serve` app on 127.0.0.1). Checked: prompts of later turns, response_mask 0 exactly
on the information tokens, logprobs aligned, the stops (answer/EOS, max_turns, response_length),
and the retriever URL plumbing from the compiled launch.
"""

import asyncio
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl

ROOT = Path(__file__).parents[2]
AGENT_LOOPS = ROOT / "experiments" / "conf" / "verl" / "agent_loops.yaml"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}\nA: {% endif %}"
"""A minimal chat template (the tiny tokenizer ships none)."""
LOGPROB = -0.5
URL = "http://127.0.0.1:1"


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("verl")
    from ema_pg_core.local.tiny import build_tokenizer

    t = build_tokenizer()
    t.chat_template = TEMPLATE
    return t


class FakeEnv:
    """Retriever stand-in: one passage naming the query."""

    def __init__(self):
        self.queries = []

    def search(self, query, k=3):
        self.queries.append(query)
        return [f"T\nabout {query}"]


class FakeServer:
    """``server_manager`` stand-in: returns `turns` in order (text, eos?) and records each call."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, list(turns), []

    async def generate(self, *, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        text, eos = self.turns.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + ([self.tok.eos_token_id] if eos else [])
        ids = ids[: sampling_params["max_tokens"]]
        return TokenOutput(token_ids=ids, log_probs=[LOGPROB] * len(ids), stop_reason="completed")


def _config(response_length=512, max_turns=4, max_info=500, url=URL, turn_tokens=None):
    from omegaconf import OmegaConf

    rollout = {
        "prompt_length": 256,
        "response_length": response_length,
        "full_determinism": False,
        "multi_turn": {"max_assistant_turns": max_turns + 1, "max_tool_response_length": max_info},
    }
    custom = {"retriever_url": url, "max_turn_tokens": turn_tokens}
    if any(v is not None for v in custom.values()):
        rollout["custom"] = {k: v for k, v in custom.items() if v is not None}
    return OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})


def _instantiate(tok, server, config):
    """What AgentLoopWorker._run_agent_loop does with a registry entry from agent_loop_config_path."""
    import hydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    (entry,) = [e for e in OmegaConf.load(AGENT_LOOPS) if e.name == "search_r1"]
    return hydra.utils.instantiate(
        entry,
        trainer_config=DictConfigWrap(config=config),
        server_manager=server,
        tokenizer=tok,
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(OmegaConf.create({})),
        tools=ToolListWrap([]),
    )


def _run(tok, turns, env=None, monkeypatch=None, **config):
    """(output, server, env) of one trajectory; the prompt is one user message."""
    from experiments.backends.verl import search_agent as verl_search_agent

    env = env or FakeEnv()
    if monkeypatch is not None:
        monkeypatch.setattr(verl_search_agent, "retriever", lambda url: env)
    server = FakeServer(tok, turns)

    async def go():  # the loop captures the running event loop at construction, as in verl's worker
        loop = _instantiate(tok, server, _config(**config))
        return await loop.run({"temperature": 1.0, "logprobs": True}, raw_prompt=[{"role": "user", "content": "Q?"}])

    return asyncio.run(go()), server, env


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _info(tok, response_text, env):
    from experiments.tasks.search import tool_response

    return _ids(tok, tool_response(response_text, env))


SEARCH, ANSWER = "<think>a</think><search> x </search>", "<answer> y </answer>"


def test_search_then_answer(tok, monkeypatch):
    out, server, env = _run(tok, [(SEARCH, False), (ANSWER, True)], monkeypatch=monkeypatch)
    t1, t2 = _ids(tok, SEARCH), _ids(tok, ANSWER) + [tok.eos_token_id]
    info = _info(tok, SEARCH, FakeEnv())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Q?"}], tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert out.prompt_ids == prompt == server.calls[0]["prompt_ids"]
    assert server.calls[1]["prompt_ids"] == prompt + t1 + info  # turn 2 sees the information
    assert env.queries == ["x"]
    assert out.response_ids == t1 + info + t2
    assert out.response_mask == [1] * len(t1) + [0] * len(info) + [1] * len(t2)
    assert out.response_logprobs == [LOGPROB] * len(t1) + [0.0] * len(info) + [LOGPROB] * len(t2)
    assert tok.decode(info).startswith("\n\n<information>Doc 1(Title: T) about x</information>")
    assert server.calls[0]["sampling_params"]["stop"] == ["</search>"]
    assert server.calls[1]["sampling_params"]["max_tokens"] == 512 - len(t1) - len(info)
    assert out.num_turns == 4  # prompt, 2 model turns, 1 information block


def test_answer_without_search_is_one_turn(tok, monkeypatch):
    out, server, env = _run(tok, [(ANSWER, False)], monkeypatch=monkeypatch)
    assert len(server.calls) == 1 and env.queries == []
    assert out.response_ids == _ids(tok, ANSWER) and out.response_mask == [1] * len(_ids(tok, ANSWER))


def test_eos_ends_the_rollout(tok, monkeypatch):
    out, server, env = _run(tok, [("<search> x", True), (ANSWER, True)], monkeypatch=monkeypatch)
    assert len(server.calls) == 1 and env.queries == []  # the model ended its turn: no retrieval
    assert out.response_ids[-1] == tok.eos_token_id and out.response_mask == [1] * (len(_ids(tok, "<search> x")) + 1)


def test_max_turns_last_turn_gets_no_information(tok, monkeypatch):
    out, server, env = _run(tok, [(SEARCH, False), (SEARCH, False)], monkeypatch=monkeypatch, max_turns=1)
    t = _ids(tok, SEARCH)
    info = _info(tok, SEARCH, FakeEnv())
    assert len(server.calls) == 2 and env.queries == ["x"]
    assert "stop" not in server.calls[1]["sampling_params"]  # the answer turn has no stop string
    assert out.response_mask == [1] * len(t) + [0] * len(info) + [1] * len(t)
    assert out.response_logprobs[-len(t) :] == [LOGPROB] * len(t)


def test_response_length_budget_truncates_information(tok, monkeypatch):
    t = _ids(tok, SEARCH)
    out, server, _ = _run(tok, [(SEARCH, False)], monkeypatch=monkeypatch, response_length=len(t) + 5)
    assert len(server.calls) == 1 and server.calls[0]["sampling_params"]["max_tokens"] == len(t) + 5
    assert out.response_ids == t + _info(tok, SEARCH, FakeEnv())[:5]
    assert out.response_mask == [1] * len(t) + [0] * 5 and len(out.response_logprobs) == len(t) + 5


def test_each_turn_is_capped_at_max_turn_tokens(tok, monkeypatch):
    t1, t2 = _ids(tok, SEARCH), _ids(tok, ANSWER) + [tok.eos_token_id]
    cap = max(len(t1), len(t2))
    out, server, _ = _run(tok, [(SEARCH, False), (ANSWER, True)], monkeypatch=monkeypatch, turn_tokens=cap)
    assert [c["sampling_params"]["max_tokens"] for c in server.calls] == [cap, cap]  # not the 512 left
    assert out.response_ids == t1 + _info(tok, SEARCH, FakeEnv()) + t2


def test_a_turn_cut_by_the_cap_before_a_search_ends_the_rollout(tok, monkeypatch):
    """As in the local backend: a turn with no complete `<search>` call gets no information and ends it."""
    out, server, env = _run(tok, [(SEARCH, False), (ANSWER, True)], monkeypatch=monkeypatch, turn_tokens=3)
    assert len(server.calls) == 1 and env.queries == []
    assert out.response_ids == _ids(tok, SEARCH)[:3] and out.response_mask == [1] * 3


def test_the_cap_never_exceeds_the_remaining_budget(tok, monkeypatch):
    t = _ids(tok, SEARCH)
    _, server, _ = _run(tok, [(SEARCH, False)], monkeypatch=monkeypatch, response_length=len(t) + 5, turn_tokens=1000)
    assert server.calls[0]["sampling_params"]["max_tokens"] == len(t) + 5


def test_information_is_capped_at_max_tool_response_length(tok, monkeypatch):
    out, _, _ = _run(tok, [(SEARCH, False), (ANSWER, True)], monkeypatch=monkeypatch, max_info=7)
    t1 = _ids(tok, SEARCH)
    assert out.response_mask[len(t1) : len(t1) + 8] == [0] * 7 + [1]


def test_tokens_past_the_stop_string_are_cut(tok, monkeypatch):
    """A server that did not honour the stop string: the turn ends after `</search>` anyway (EOS too)."""
    out, server, _ = _run(tok, [(SEARCH + " more", True), (ANSWER, True)], monkeypatch=monkeypatch)
    t1, info = _ids(tok, SEARCH), _info(tok, SEARCH, FakeEnv())
    assert server.calls[1]["prompt_ids"] == out.prompt_ids + t1 + info
    assert out.response_mask == [1] * len(t1) + [0] * len(info) + [1] * (len(_ids(tok, ANSWER)) + 1)
    assert out.response_logprobs[: len(t1)] == [LOGPROB] * len(t1)


def test_cut_after_stop(tok):
    from experiments.backends.verl.search_agent import cut_after_stop

    ids = _ids(tok, "ab</search>cd")
    assert cut_after_stop(tok, ids) == len(_ids(tok, "ab</search>"))
    assert cut_after_stop(tok, _ids(tok, "ab</search>") + [tok.eos_token_id]) == len(_ids(tok, "ab</search>"))
    assert cut_after_stop(tok, _ids(tok, "abcd")) == 4 and cut_after_stop(tok, []) == 0


def test_missing_retriever_url_names_the_setting(tok):
    with pytest.raises(Exception, match=r"backend\.verl\.retriever_url") as err:  # hydra wraps it, as in verl
        _run(tok, [(ANSWER, True)], url=None)
    assert isinstance(err.value.__cause__, ValueError)


def test_against_the_retriever_server(tok):
    """The real HTTP client and `emapg retriever serve` app, on 127.0.0.1 (an OS-chosen port)."""
    pytest.importorskip("bm25s")
    from experiments.ops.retrieval.bm25 import BM25Retriever
    from experiments.ops.retrieval.service import running_server

    with running_server(BM25Retriever(["Paris\nParis is the capital of France.", "Rome\nRome is in Italy."])) as url:
        out, server, _ = _run(tok, [("<search> capital of France </search>", False), (ANSWER, True)], url=url)
    text = tok.decode(out.response_ids, skip_special_tokens=True)
    assert "<information>Doc 1(Title: Paris) Paris is the capital of France." in text
    assert len(server.calls) == 2


def test_search_preset_launch_reaches_the_loop(tmp_path, tiny_path):
    """The compiled search preset composes against verl's config and carries the loop's settings."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from experiments import build
    from experiments.backends.verl.launch import to_verl
    from experiments.backends.verl.main import compose
    from experiments.run import agent_loops_path

    cfg = build.compose(["experiment=search_r1_ema_pg"])
    cfg = OmegaConf.merge(cfg, agent_loops_path(cfg))
    assert Path(cfg.backend.verl.agent_loop_config_path) == AGENT_LOOPS  # absolute, whatever the cwd
    job = to_verl(OmegaConf.to_container(cfg, resolve=True))
    verl_cfg = compose(job.argv() + [f"actor_rollout_ref.model.path={tiny_path}"])
    rollout = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.rollout)
    assert rollout.agent.default_agent_loop == "search_r1" and rollout.agent.agent_loop_config_path == str(AGENT_LOOPS)
    assert rollout.custom == {"retriever_url": "http://127.0.0.1:8000", "max_turn_tokens": 500}  # per turn
    assert rollout.multi_turn.max_assistant_turns == 5 and rollout.multi_turn.tool_config_path is None
