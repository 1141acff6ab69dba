"""Sampling-time pi_old statistics (trainer.old_logprobs=rollout) against the recomputing forward pass.

Both are pi_old at the rollout temperature: the decode's KV-cache logits and a full right-padded
forward differ only by float rounding. In fp32 on these tiny models the statistics agree to 2e-5 and
the first PPO step's loss and gradients to RTOL/ATOL below (the documented tolerance,
docs/algorithm.md "Where pi_old comes from").
"""

from dataclasses import replace

import pytest
import torch

from ema_pg_core.config import AlgoConfig, AnchorConfig, KLConfig, RolloutConfig, TrainerConfig
from ema_pg_core.local.batch import collate, forward_stats, sampler_stats
from ema_pg_core.local.rollout import rollout
from ema_pg_core.local.tiny import build_model, build_tokenizer
from ema_pg_core.local.trainer import LocalConfig, LocalTrainer
from tests.core.test_local import Toy

TOK = build_tokenizer()
STATS_ATOL = 2e-5  # fp32 logits of O(1): rounding of two summation orders
RTOL, ATOL = 1e-4, 5e-7  # first-step loss and gradients (fp32); measured: <= 6e-8 abs, 6e-7 rel


def _model(seed=1):
    return build_model(TOK, hidden=32, layers=2, heads=2, seed=seed)


def _check_against_forward(model, trajs, k, temperature):
    """Sampler statistics equal the forward pass's at every model token (mask 1)."""
    batch = collate(trajs, TOK.pad_token_id)
    with torch.no_grad():
        ref, _ = forward_stats(model, batch, k=k, temperature=temperature, entropy=True)
    got = sampler_stats(trajs)
    m = batch.mask.bool()  # (B, T)
    assert m.sum() > 0
    for f in ("logp", "lse", "entropy"):
        torch.testing.assert_close(getattr(got, f)[m], getattr(ref, f)[m], rtol=0, atol=STATS_ATOL, msg=f)
    assert got.indices.shape == ref.indices.shape and torch.equal(got.indices[m], ref.indices[m])
    torch.testing.assert_close(got.logits_k[m], ref.logits_k[m], rtol=0, atol=STATS_ATOL)
    return got, batch


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampler_statistics_equal_the_forward_pass(temperature, top_p):
    """Left-padded prompts of different lengths; top-p only truncates the sampler, never the statistics."""
    model = _model().eval()
    prompts = ["1>", "23>", "456>", "7>"] * 2
    g = torch.Generator().manual_seed(0)
    trajs = rollout(
        model, TOK, prompts, max_new_tokens=12, temperature=temperature, top_p=top_p, generator=g, stats_k=5
    )
    assert len({len(t.response_ids) for t in trajs}) > 1  # rows of different lengths: padding exercised
    _check_against_forward(model, trajs, k=5, temperature=temperature)


class _OnHash:
    """A tool environment whose stop string is one frequent character, so a random model calls it."""

    stop = "#"

    def respond(self, text):
        return "<information>x</information>"


def test_tool_loop_statistics_align_and_environment_tokens_are_zero():
    model = _model().eval()
    g = torch.Generator().manual_seed(0)
    trajs = rollout(
        model, TOK, ["1>", "2>", "3>"], max_new_tokens=30, temperature=2.0, generator=g, env=_OnHash(), max_turns=2,
        stats_k=3,
    )  # fmt: skip
    assert any(t.turns > 0 for t in trajs)  # the loop really injected observations
    got, batch = _check_against_forward(model, trajs, k=3, temperature=2.0)
    env = (batch.mask == 0) & (batch.tokens != 0)  # environment tokens inside the responses
    assert env.sum() > 0
    for f in ("logp", "lse", "logits_k", "entropy"):
        assert torch.all(getattr(got, f)[env] == 0), f
    for t in trajs:  # masking unchanged: one stats row per response token, mask as before
        assert t.stats.logp.shape[0] == len(t.response_ids) == len(t.response_mask)


def _cfg(kl, source, tail="unbiased"):
    return LocalConfig(
        algo=AlgoConfig(
            kl=KLConfig(type=kl, k=4, tail=tail, coef=0.5, use_iw=True),
            anchor=AnchorConfig(tau=0.5, period=1),
        ),
        rollout=RolloutConfig(max_new_tokens=6, prompts_per_iter=4, group_size=4, temperature=0.9),
        trainer=TrainerConfig(iterations=1, mini_batches=1, save_every=0, old_logprobs=source),
        seed=3,
    )


def _first_step(kl, source, tail, tmp_path):
    """(metrics, {param name: grad}) of one iteration; the anchor is perturbed so the KL is not 0."""
    torch.manual_seed(0)
    tr = LocalTrainer(_model(seed=0), TOK, Toy(), _cfg(kl, source, tail), tmp_path / source)
    with torch.no_grad():
        for p in tr.anchor.module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    grads = {}

    def record(*_):  # before the (only) optimizer step of the iteration
        grads.update({n: p.grad.clone() for n, p in tr.policy.named_parameters() if p.grad is not None})

    tr.opt.register_step_pre_hook(record)
    return tr.step(), grads


@pytest.mark.parametrize(
    "kl,tail",
    [("k3", "unbiased"), ("topk_reverse", "unbiased"), ("topk_reverse", "paper"), ("topk_reverse", "none"),
     ("topk_forward", "unbiased")],
)  # fmt: skip
def test_first_ppo_step_matches_the_recomputing_path(kl, tail, tmp_path):
    m_new, g_new = _first_step(kl, "rollout", tail, tmp_path)
    m_old, g_old = _first_step(kl, "recompute", tail, tmp_path)
    assert m_new["kl/value"] != 0 and m_new["train/response_len"] == m_old["train/response_len"]
    for key in ("loss/total", "loss/pg", "kl/value", "train/entropy"):
        assert m_new[key] == pytest.approx(m_old[key], rel=RTOL, abs=ATOL), key
    assert g_new.keys() == g_old.keys() and len(g_new) > 0
    for name in g_new:
        torch.testing.assert_close(g_new[name], g_old[name], rtol=RTOL, atol=ATOL, msg=name)


def test_verl_refuses_sampler_statistics():
    from experiments.backends.verl.launch import to_verl

    with pytest.raises(ValueError, match="trainer.old_logprobs=rollout is not allowed with the verl backend"):
        to_verl({"trainer": {"old_logprobs": "rollout"}, "model": {"path": "m"}})


def test_old_logprobs_is_validated():
    with pytest.raises(ValueError, match="trainer.old_logprobs='x' is not allowed; allowed values: auto, rollout"):
        replace(TrainerConfig(), old_logprobs="x")


def test_statistics_do_not_depend_on_how_many_steps_are_buffered(monkeypatch):
    import ema_pg_core.local.rollout as R

    model = _model().eval()

    def sample():
        g = torch.Generator().manual_seed(0)
        return rollout(model, TOK, ["1>", "23>", "4>"], max_new_tokens=10, generator=g, stats_k=3)

    batched = sample()  # all steps in one batch (the buffer holds them all)
    monkeypatch.setattr(R, "STATS_BUFFER_BYTES", 1)  # one step per batch
    stepwise = sample()
    for a, b in zip(batched, stepwise):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(a.stats.logp, b.stats.logp, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.stats.entropy, b.stats.entropy, rtol=0, atol=1e-6)
        assert torch.equal(a.stats.indices, b.stats.indices)
