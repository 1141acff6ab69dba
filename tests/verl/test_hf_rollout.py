"""The hf rollout engine (experiments.backends.verl.hf_rollout) outside Ray: sampling settings, stop strings,
log-probs, batching of concurrent requests, weight syncs, and the registration in verl's registries."""

import asyncio
import types

import pytest
import torch

pytestmark = pytest.mark.verl


def _server(tiny_path, **rollout):
    from verl.workers.config import RolloutConfig

    from experiments.backends.verl.hf_rollout import HFGenerationServer

    cfg = RolloutConfig(name="hf", prompt_length=16, response_length=12, **rollout)
    mc = types.SimpleNamespace(
        local_path=tiny_path, path=tiny_path, trust_remote_code=False, override_config={"attn_implementation": "eager"}
    )
    return HFGenerationServer(cfg, mc)


def test_sampling_params_and_the_cut():
    from experiments.backends.verl.hf_rollout import Sampling, cut

    s = Sampling.from_params(
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "repetition_penalty": 1.0,
            "logprobs": True,
            "stop": "</search>",
        },
        default_max_tokens=10,
    )
    got = (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop, s.logprobs)
    assert got == (10, 0.7, 0.9, -1, ("</search>",), True)
    assert Sampling.from_params({"max_tokens": 3}, 10).max_tokens == 3
    with pytest.raises(ValueError, match=r"does not support sampling params \['best_of'\]"):
        Sampling.from_params({"best_of": 2}, 10)
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731  1 -> "a", 2 -> "b", ...
    assert cut([1, 2, 3, 9, 4], {9}, (), decode) == 4  # through the eos
    assert cut([1, 2, 3, 9, 4], {9}, (), decode, ignore_eos=True) == 5
    assert cut([1, 2, 3, 4, 9], {9}, ("bc",), decode) == 3  # through the token completing the stop string
    assert cut([1, 2], {9}, ("zz",), decode) == 2


def test_generate_greedy_is_the_models_argmax_with_its_logprobs(tiny_path):
    from transformers import AutoModelForCausalLM

    srv = _server(tiny_path)
    prompt = [5, 6, 7, 8]
    out = asyncio.run(srv.generate(prompt, {"temperature": 0, "max_tokens": 6, "logprobs": True}, "r0"))
    model = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="eager", dtype=torch.float32)
    ids, logps = list(prompt), []
    for _ in range(len(out.token_ids)):
        logits = model(torch.tensor([ids])).logits[0, -1]
        logps.append(torch.log_softmax(logits, -1).max().item())
        ids.append(int(logits.argmax()))
    assert out.token_ids == ids[len(prompt) :] and out.stop_reason == "completed"
    assert out.log_probs == pytest.approx(logps, abs=1e-4)


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(tiny_path):
    srv = _server(tiny_path)
    calls = []
    original = srv._generate_group
    srv._generate_group = lambda prompts, s: calls.append(len(prompts)) or original(prompts, s)

    async def many():
        greedy = {"temperature": 0, "max_tokens": 5}
        return await asyncio.gather(*[srv.generate([5 + i, 6, 7], dict(greedy), f"r{i}") for i in range(6)])

    outs = asyncio.run(many())
    singles = [
        asyncio.run(srv.generate([5 + i, 6, 7], {"temperature": 0, "max_tokens": 5}, "s")).token_ids for i in range(6)
    ]
    assert [o.token_ids for o in outs] == singles  # left padding changes nothing
    assert calls[0] > 1  # requests that arrived together ran as one batch


def test_stop_strings_end_a_turn_and_weight_syncs_change_the_model(tiny_path):
    srv = _server(tiny_path)
    tok = srv.tokenizer
    free = asyncio.run(srv.generate([5, 6, 7], {"temperature": 0, "max_tokens": 8}, "a")).token_ids
    stop = tok.decode(free[:2])
    cut = asyncio.run(srv.generate([5, 6, 7], {"temperature": 0, "max_tokens": 8, "stop": [stop]}, "b")).token_ids
    assert stop in tok.decode(cut) and len(cut) <= len(free) and stop not in tok.decode(cut[:-1])
    weights = {k: torch.zeros_like(v) for k, v in srv.model.state_dict().items()}
    assert srv.update_weights(weights, global_steps=3) == len(weights)
    assert srv.global_steps == 3 and all(float(v.abs().sum()) == 0 for v in srv.model.state_dict().values())
    with pytest.raises(KeyError, match="does not have"):
        srv.update_weights({"not.a.weight": torch.zeros(1)})


def test_registered_in_both_verl_registries():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplica, get_rollout_replica_class

    from experiments.backends.verl import hf_rollout

    hf_rollout.register()
    assert issubclass(get_rollout_replica_class("hf"), RolloutReplica)
    assert get_rollout_class("hf", "async").__name__ == "HFServerAdapter"
