"""The local trainer: tool loop, observation masking, resume exactness, fused == unfused, anchor eval."""

from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from ema_pg_core.config import AlgoConfig, AnchorConfig, KLConfig, RolloutConfig, TrainerConfig
from ema_pg_core.kl import KLInputs
from ema_pg_core.local.batch import collate, forward_stats
from ema_pg_core.local.rollout import rollout
from ema_pg_core.local.tiny import build_model, build_tokenizer
from ema_pg_core.local.trainer import Hooks, LocalConfig, LocalTrainer
from ema_pg_core.loss import policy_loss

TOK = build_tokenizer()


# ------------------------------------------------------------------ a scripted LM for the tool loop
class ScriptedLM(torch.nn.Module):
    """Emits, after the prompt or after each '</information>', the next turn's target text then eos.

    Its "cache" is the token context so far, so it works with the KV-cache generation loop.
    """

    def __init__(self, targets):
        super().__init__()
        self.targets = targets
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.V = len(TOK)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        ctx = input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], 1)
        logits = torch.full((ctx.shape[0], 1, self.V), -1e9)
        for b in range(ctx.shape[0]):
            text = TOK.decode(ctx[b], skip_special_tokens=True)
            n = text.count("</information>")
            tail = text.rsplit("</information>", 1)[-1] if n else text.split("?", 1)[-1]
            target = self.targets[min(n, len(self.targets) - 1)]
            nxt = TOK.eos_token_id if len(tail) >= len(target) else TOK.convert_tokens_to_ids(target[len(tail)])
            logits[b, 0, nxt] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=ctx)


class Env:
    stop = "</search>"

    def __init__(self):
        self.calls = []

    def respond(self, text):
        q = text.rsplit("<search>", 1)[-1][: -len(self.stop)]
        self.calls.append(q)
        return f"<information>doc about {q}</information>"


def test_tool_loop_stops_injects_and_respects_max_turns():
    env = Env()
    model = ScriptedLM(["<search>a</search>", "<search>b</search>", "<search>c</search>"])
    (tr,) = rollout(model, TOK, ["Q?"], max_new_tokens=40, env=env, max_turns=2, greedy=True)
    assert env.calls == ["a", "b"] and tr.turns == 2
    # final turn: no stop string, so the third search is plain text and nothing is injected
    assert tr.text == (
        "<search>a</search><information>doc about a</information>"
        "<search>b</search><information>doc about b</information><search>c</search>"
    )
    # environment tokens are in the context with mask 0, model tokens (incl. eos) mask 1
    masked = TOK.decode([t for t, m in zip(tr.response_ids, tr.response_mask) if m == 0])
    assert masked == "<information>doc about a</information><information>doc about b</information>"
    assert sum(tr.response_mask) == 3 * len("<search>a</search>") + 1  # + the final eos


def test_tool_loop_answer_ends_the_episode():
    env = Env()
    model = ScriptedLM(["<search>x</search>", "<answer>y</answer>"])
    (tr,) = rollout(model, TOK, ["Q?"], max_new_tokens=40, env=env, max_turns=3, greedy=True)
    assert tr.turns == 1 and tr.text.endswith("<answer>y</answer>") and env.calls == ["x"]


def test_observation_tokens_get_zero_loss_weight():
    env = Env()
    model = ScriptedLM(["<search>a</search>", "<answer>b</answer>"])
    trajs = rollout(model, TOK, ["Q?", "Q?"], max_new_tokens=40, env=env, max_turns=2, greedy=True)
    batch = collate(trajs, TOK.pad_token_id)
    assert batch.mask.tolist()[0][: len(trajs[0].response_mask)] == trajs[0].response_mask
    logp = torch.randn(batch.mask.shape, requires_grad=True)
    x = KLInputs(logp=logp, ref_logp=torch.zeros_like(logp))
    loss, _ = policy_loss(
        logp,
        logp.detach(),
        torch.tensor([1.0, -1.0]),
        batch.mask,
        x,
        loss_cfg=AlgoConfig().loss,
        kl_cfg=KLConfig(type="k3", coef=0.5),
    )
    (g,) = torch.autograd.grad(loss, logp)
    assert (g[batch.mask == 0] == 0).all() and (g[batch.mask == 1] != 0).all()


# ------------------------------------------------------------------ a toy task for the trainer
@dataclass
class Ex:
    id: int
    q: str
    a: str


class Toy:
    """Answer the next digit: '3>' -> '4'."""

    name, env = "toy", None

    def __init__(self):
        self.train = [Ex(i, str(i % 10), str((i + 1) % 10)) for i in range(60)]
        self.test = self.train[:6]

    def prompt(self, e):
        return f"{e.q}>"

    def reward(self, e, r):
        return float(r[:1] == e.a or r[:1] in "13579")  # some signal even for a random model

    def evaluate(self, e, r):
        return int(r[:1] == e.a)


def make_cfg(kl="topk_reverse", fused=True, iterations=4, **kl_kw):
    return LocalConfig(
        algo=AlgoConfig(
            kl=KLConfig(type=kl, k=4, fused=fused, coef=0.05, use_iw=True, **kl_kw),
            anchor=AnchorConfig(tau=0.5, period=1),
        ),
        rollout=RolloutConfig(max_new_tokens=3, prompts_per_iter=4, group_size=4),
        trainer=TrainerConfig(iterations=iterations, eval_every=2, eval_size=6, eval_n=2, save_every=2, mini_batches=2),
        seed=3,
    )


def train(cfg, ckpt_dir, dtype=torch.float32, resume_from=None, stop_after=None):
    torch.manual_seed(0)
    policy = build_model(TOK, hidden=32, layers=1, heads=2, seed=0).to(dtype)
    log = {}
    tr = LocalTrainer(policy, TOK, Toy(), cfg, ckpt_dir, hooks=Hooks(metrics=lambda it, m: log.__setitem__(it, m)))
    if resume_from:
        tr.resume(resume_from)
    if stop_after:
        tr.cfg = replace(cfg, trainer=replace(cfg.trainer, iterations=stop_after))
    tr.train()
    return tr, {it: {k: v for k, v in m.items() if not k.startswith("perf/")} for it, m in log.items()}


def test_resume_continues_exactly(tmp_path):
    cfg = make_cfg()
    _, full = train(cfg, tmp_path / "a")
    first, part1 = train(cfg, tmp_path / "b", stop_after=2)
    ckpt = LocalTrainer.latest_checkpoint(tmp_path / "b")
    assert ckpt.name == "iter_000002"
    _, part2 = train(cfg, tmp_path / "b", resume_from=ckpt)
    assert sorted(part1) == [0, 1, 2] and sorted(part2) == [3, 4]
    assert {**part1, **part2} == full


@pytest.mark.parametrize("kl", ["topk_reverse", "topk_forward", "k3", "exact_reverse"])
def test_fused_and_unfused_give_identical_metrics(kl, tmp_path):
    _, a = train(make_cfg(kl, fused=True, iterations=2), tmp_path / "f", dtype=torch.float64)
    _, b = train(make_cfg(kl, fused=False, iterations=2), tmp_path / "u", dtype=torch.float64)
    assert a.keys() == b.keys()
    for it in a:
        assert a[it].keys() == b[it].keys()
        for k in a[it]:
            assert a[it][k] == pytest.approx(b[it][k], rel=1e-9, abs=1e-12), (it, k)


def test_smoke_training_changes_parameters_and_evaluates_the_anchor(tmp_path):
    tr, log = train(make_cfg(iterations=2), tmp_path)
    init = build_model(TOK, hidden=32, layers=1, heads=2, seed=0)
    changed = any(not torch.equal(p, q) for p, q in zip(tr.policy.parameters(), init.parameters()))
    assert changed
    assert all(torch.isfinite(torch.tensor(v)) for v in log[2].values())
    for key in (
        "eval/toy/acc",
        "eval/toy/pass@1",
        "eval_anchor/toy/acc",
        "eval_anchor/toy/pass@1",
        "kl/value",
        "anchor/drift",
    ):
        assert key in log[2]
    assert log[2]["anchor/updated"] == 1.0 and tr.anchor.num_updates == 2


def test_anchor_stats_use_pi_old_indices_for_reverse_and_own_for_forward(tmp_path):
    policy = build_model(TOK, hidden=32, layers=1, heads=2, seed=1)
    for direction, source in [(d, s) for d in ("reverse", "forward") for s in ("auto", "recompute")]:
        cfg = make_cfg(f"topk_{direction}")
        cfg = replace(cfg, trainer=replace(cfg.trainer, old_logprobs=source))
        tr = LocalTrainer(policy, TOK, Toy(), cfg, tmp_path)
        g = torch.Generator().manual_seed(0)
        trajs = rollout(policy, TOK, ["1>", "2>"], max_new_tokens=3, generator=g, stats_k=tr._sampler_k())
        assert (trajs[0].stats is None) == (source == "recompute")
        batch = collate(trajs, TOK.pad_token_id)
        with torch.no_grad():
            for p in tr.anchor.module.parameters():
                p.add_(0.3 * torch.randn_like(p))
        old, anc, _ = tr._reference_stats(batch, trajs)
        own_anchor, _ = forward_stats(tr.anchor.module, batch, k=4)
        if direction == "reverse":
            assert old.indices.shape[-1] == 4 and torch.equal(anc.indices, old.indices)
        else:
            assert old.indices.shape[-1] == 0 and torch.equal(anc.indices, own_anchor.indices)


def test_k_larger_than_vocabulary_is_rejected(tmp_path):
    policy = build_model(TOK, hidden=32, layers=1, heads=2, seed=0)
    with pytest.raises(ValueError, match="algo.kl.k=999 exceeds the model's vocabulary size"):
        LocalTrainer(policy, TOK, Toy(), replace(make_cfg(), algo=AlgoConfig(kl=KLConfig(k=999))), tmp_path)


def test_run_metrics_are_the_keys_one_local_iteration_logs(tmp_path):
    """sweeps.spec.RUN_METRICS and EVAL_METRICS are exactly the keys the local trainer logs (one iteration)."""
    from ema_pg_core.telemetry import TOPK_KEYS
    from sweeps.spec import EVAL_METRICS, RUN_METRICS

    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = LocalConfig(
        algo=AlgoConfig(kl=KLConfig(k=4), anchor=AnchorConfig(tau=0.5, period=1)),  # KL on: kl/value
        rollout=RolloutConfig(max_new_tokens=2, prompts_per_iter=2, group_size=2),
        trainer=TrainerConfig(iterations=1, eval_size=2, eval_n=1, mini_batches=1),
        seed=0,
    )
    trainer = LocalTrainer(build_model(tok, hidden=16, layers=1, heads=2, seed=0), tok, Toy(), cfg, tmp_path)
    logged = trainer.step()  # + the Top-k telemetry (default estimator topk_reverse); no probe at iteration 1
    want = RUN_METRICS + TOPK_KEYS
    assert sorted(logged) == sorted(want), set(logged) ^ set(want)
    evals, _ = trainer.evaluate()
    assert sorted(evals) == sorted(f"{ns}/toy/{m}" for ns in ("eval", "eval_anchor") for m in EVAL_METRICS)


# ------------------------------------------------------------------ temperature 0 = greedy (issue #28)
def test_temperature_zero_decodes_greedily_and_a_negative_one_is_refused():
    model = build_model(TOK, hidden=32, layers=1, heads=2, seed=0).eval()
    prompts = ["1>", "2>", "3>", "4>"]
    greedy = rollout(model, TOK, prompts, max_new_tokens=6, greedy=True)
    zero = rollout(model, TOK, prompts, max_new_tokens=6, temperature=0.0, generator=torch.Generator().manual_seed(0))
    assert [t.response_ids for t in zero] == [t.response_ids for t in greedy]
    with pytest.raises(ValueError, match=r"temperature must be >= 0 \(0 = greedy\); got -1.0"):
        rollout(model, TOK, prompts, max_new_tokens=2, temperature=-1.0, generator=torch.Generator())


@pytest.mark.parametrize("eval_temperature", [0.0, 0.7])
def test_eval_temperature_is_honoured_and_zero_means_greedy(eval_temperature, tmp_path, monkeypatch):
    """trainer.eval_temperature=0 evaluates greedily (it used to become the rollout temperature, 1.0); any other value
    samples at that temperature."""
    import ema_pg_core.local.trainer as trainer_module

    calls = []

    def spy(*args, **kw):
        calls.append((kw["greedy"], kw["temperature"]))
        return rollout(*args, **kw)

    monkeypatch.setattr(trainer_module, "rollout", spy)
    cfg = make_cfg(iterations=0)
    cfg = replace(cfg, trainer=replace(cfg.trainer, eval_temperature=eval_temperature, eval_n=3, probe_every=0))
    tr = LocalTrainer(build_model(TOK, hidden=32, layers=1, heads=2, seed=0), TOK, Toy(), cfg, tmp_path)
    metrics, rows = tr.evaluate()
    if eval_temperature == 0:
        assert all(greedy or t == 0 for greedy, t in calls), calls
        assert metrics["eval/toy/pass@1"] == metrics["eval/toy/acc"]
        assert all(r["n_correct"] == r["n"] * r["greedy_correct"] for r in rows)
    else:
        assert (False, eval_temperature) in calls
