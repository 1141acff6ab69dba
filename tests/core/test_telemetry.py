"""KL telemetry (ema_pg_core.telemetry, ema_pg_core.local.probe): the exact KL on the probe against a direct
full-softmax computation, the estimate on the probe against the estimator applied to the same tokens, the
Top-k head mass against the sum of the top-k probabilities, tail_frac at k = |V| and k = 0, and a resumed
run that scores the same probe."""

from dataclasses import replace

import pytest
import torch

from ema_pg_core.config import KLConfig, LossConfig, TrainerConfig
from ema_pg_core.kl import ImportanceWeight, KLInputs, aggregate, kl_per_token
from ema_pg_core.local.batch import response_hidden
from ema_pg_core.local.probe import make_probe, probe_batch, score_probe
from ema_pg_core.local.tiny import build_model
from ema_pg_core.local.trainer import LocalTrainer
from ema_pg_core.loss import policy_loss
from ema_pg_core.telemetry import (
    PROBE_KEYS,
    TOPK_FORWARD_KEYS,
    TOPK_KEYS,
    exact_kl_from_hidden,
    exact_kl_from_logits,
    topk_parts,
    topk_summary,
)
from tests.core.test_local import TOK, Toy, make_cfg, train

V = len(TOK)


def _direct_kl(z, zr, direction):
    """(...,) KL by a plain full softmax over the last axis (float64)."""
    lp, lr = torch.log_softmax(z.double(), -1), torch.log_softmax(zr.double(), -1)
    if direction == "forward":
        lp, lr = lr, lp
    return (lp.exp() * (lp - lr)).sum(-1)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("vchunk", [None, 7, 64])
def test_exact_kl_in_blocks_equals_the_full_softmax(direction, vchunk):
    g = torch.Generator().manual_seed(0)
    B, T, H, n = 3, 5, 8, 50
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731  fp64: exact regime
    h, hr, w, wr, b = r(B, T, H), r(B, T, H), r(n, H), r(n, H), r(n)
    got = exact_kl_from_hidden(h, w, b, ref_hidden=hr, ref_weight=wr, ref_bias=None, direction=direction,
                               temperature=0.7, chunk_size=4, vocab_chunk_size=vchunk)  # fmt: skip
    want = _direct_kl((h @ w.T + b) / 0.7, (hr @ wr.T) / 0.7, direction)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    z, zr = r(7, n) * 3, r(7, n) * 3
    got = exact_kl_from_logits(z, zr, direction=direction, chunk_size=2, vocab_chunk_size=vchunk)
    torch.testing.assert_close(got.double(), _direct_kl(z, zr, direction), atol=1e-6, rtol=0)
    assert (exact_kl_from_logits(z, z, direction=direction) == 0).all()


def _trainer(tmp_path, kl_type, k=4, tail="unbiased", **kl_kw):
    cfg = make_cfg(kl_type, iterations=1, tail=tail, **kl_kw)
    cfg = replace(cfg, algo=replace(cfg.algo, kl=replace(cfg.algo.kl, k=k)))
    policy = build_model(TOK, hidden=32, layers=1, heads=2, seed=0).double()
    tr = LocalTrainer(policy, TOK, Toy(), cfg, tmp_path)
    with torch.no_grad():  # an anchor away from the policy: a KL well above rounding
        g = torch.Generator().manual_seed(1)
        for p in tr.anchor.module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return tr


def _direct_estimate(tr, probe, kl: KLConfig):
    """The estimator applied to the probe tokens from full (P, T, V) logits, without the chunked paths."""
    batch = probe_batch(probe, "cpu")
    z = tr.policy.get_output_embeddings()(response_hidden(tr.policy, batch))  # (P, T, V), temperature 1
    zr = tr.anchor.module.get_output_embeddings()(response_hidden(tr.anchor.module, batch))
    lp, lr = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    tok = batch.tokens[..., None]
    idx = torch.topk(z if kl.type == "topk_reverse" else zr, kl.k, -1).indices  # (P, T, k)
    x = KLInputs(
        logp=lp.gather(-1, tok)[..., 0], ref_logp=lr.gather(-1, tok)[..., 0], old_logp=probe["logp"],
        sampled=batch.tokens, topk_idx=idx, logits_k=z.gather(-1, idx), lse=torch.logsumexp(z, -1),
        ref_logits_k=zr.gather(-1, idx), ref_lse=torch.logsumexp(zr, -1), logits=z, ref_logits=zr,
    )  # fmt: skip
    est = kl_per_token(kl.type, x, tail=kl.tail, iw=ImportanceWeight(True))
    return z, zr, batch.mask, est


@pytest.mark.parametrize(
    "kl_type,tail,agg",
    [("topk_reverse", "unbiased", "token-mean"), ("topk_reverse", "paper", "seq-mean-token-mean"),
     ("topk_forward", "paper", "token-mean"), ("k3", "unbiased", "token-mean"), ("k4", "unbiased", "token-mean"),
     ("exact_forward", "unbiased", "token-mean")],
)  # fmt: skip
def test_probe_exact_and_estimate_equal_direct_computations(tmp_path, kl_type, tail, agg):
    tr = _trainer(tmp_path, kl_type, tail=tail)
    probe = make_probe(tr)
    kl = tr.cfg.algo.kl
    m = score_probe(tr.policy, tr.anchor.module, probe, kl, agg=agg, temperature=1.0)
    z, zr, mask, est = _direct_estimate(tr, probe, kl)
    direction = "forward" if kl_type in ("topk_forward", "exact_forward") else "reverse"
    exact = aggregate(_direct_kl(z, zr, direction), mask.double(), agg).item()
    assert m["kl/exact"] == pytest.approx(exact, abs=1e-6) and exact > 1e-3
    assert m["kl/estimate_on_probe"] == pytest.approx(aggregate(est, mask.double(), agg).item(), abs=1e-6)
    assert m["kl/estimate_gap"] == m["kl/estimate_on_probe"] - m["kl/exact"]
    assert sorted(m) == sorted(PROBE_KEYS)


def _topk_inputs(k, seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    z, zr = (
        torch.randn(B, T, V, generator=g, dtype=torch.float64),
        torch.randn(B, T, V, generator=g, dtype=torch.float64),
    )
    tokens = torch.multinomial(torch.softmax(z, -1).view(-1, V), 1, generator=g).view(B, T)
    idx = torch.topk(z, k, -1).indices  # (B, T, k)
    lp, lr = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    x = KLInputs(
        logp=lp.gather(-1, tokens[..., None])[..., 0].requires_grad_(),
        ref_logp=lr.gather(-1, tokens[..., None])[..., 0],
        old_logp=None, sampled=tokens, topk_idx=idx, logits_k=z.gather(-1, idx), lse=torch.logsumexp(z, -1),
        ref_logits_k=zr.gather(-1, idx), ref_lse=torch.logsumexp(zr, -1),
    )  # fmt: skip
    return x, z, zr, tokens, idx


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_head_mass_is_the_sum_of_the_topk_probabilities(direction):
    x, z, zr, tokens, idx = _topk_inputs(k=5)
    mask = torch.ones(tokens.shape, dtype=torch.float64)
    mask[0, 3:] = 0
    name = f"topk_{direction}"
    parts = topk_parts(x, name, tail="unbiased", iw=ImportanceWeight())
    want = torch.softmax(z, -1).topk(5, -1).values.sum(-1)  # (B, T) by plain sorting
    torch.testing.assert_close(parts["head_mass"], want)
    torch.testing.assert_close(parts["anchor_head_mass"], torch.softmax(zr, -1).gather(-1, idx).sum(-1))
    s = topk_summary(parts, mask, direction)
    assert s["topk/head_mass"] == pytest.approx(float((want * mask).sum() / mask.sum()), abs=1e-12)
    inside = (idx == tokens[..., None]).any(-1).double()
    assert s["topk/tail_frac"] == pytest.approx(float(((1 - inside) * mask).sum() / mask.sum()), abs=1e-12)
    assert sorted(s) == sorted(TOPK_KEYS + (TOPK_FORWARD_KEYS if direction == "forward" else ()))


@pytest.mark.parametrize("name", ["topk_reverse", "topk_forward"])
def test_tail_frac_is_0_at_k_equal_to_V_and_1_at_k_0(name):
    mask = torch.ones(4, 6, dtype=torch.float64)
    loss_cfg = LossConfig()
    for k, frac, share in ((V, 0.0, 0.0), (0, 1.0, 1.0)):
        x, *_ = _topk_inputs(k=k)
        _, stats = policy_loss(
            x.logp, x.logp.detach(), torch.zeros(4), mask, x, loss_cfg=loss_cfg, kl_cfg=KLConfig(type=name, k=k)
        )
        assert stats["topk/tail_frac"] == frac and stats["topk/tail_share"] == pytest.approx(share, abs=1e-12)
        assert stats["topk/head_mass"] == pytest.approx(1.0 if k == V else 0.0, abs=1e-12)


def _probed(cfg, every=1):
    return replace(cfg, trainer=replace(cfg.trainer, probe_every=every, probe_size=3))


def test_resumed_run_scores_the_same_probe(tmp_path):
    cfg = _probed(make_cfg())
    _, full = train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b", stop_after=2)
    _, part2 = train(cfg, tmp_path / "b", resume_from=LocalTrainer.latest_checkpoint(tmp_path / "b"))
    assert all(k in full[it] for it in (1, 2, 3, 4) for k in PROBE_KEYS + TOPK_KEYS)
    assert full[3] == part2[3] and full[4] == part2[4]  # the probe's tokens came back from the checkpoint


def test_probe_leaves_training_unchanged_and_probe_every_0_turns_it_off(tmp_path):
    _, on = train(_probed(make_cfg(iterations=2), every=2), tmp_path / "on")
    _, off = train(_probed(make_cfg(iterations=2), every=0), tmp_path / "off")
    assert "kl/exact" not in on[1] and "kl/exact" in on[2]  # every 2 iterations
    assert not any(k in m for m in off.values() for k in PROBE_KEYS)
    assert {k: v for k, v in on[2].items() if k not in PROBE_KEYS} == off[2]  # its own generator


def test_probe_settings_are_validated():
    with pytest.raises(ValueError, match=r"trainer\.probe_every must be an integer >= 0"):
        TrainerConfig(probe_every=-1)
    with pytest.raises(ValueError, match=r"trainer\.probe_size must be an integer >= 1"):
        TrainerConfig(probe_size=0)


def test_probe_every_null_is_every_5_iterations_on_both_backends():
    from ema_pg_core.config import PROBE_EVERY
    from experiments.backends.verl.launch import to_verl

    assert TrainerConfig().resolved_probe_every == PROBE_EVERY > 0
    assert TrainerConfig(probe_every=0).resolved_probe_every == 0
    assert TrainerConfig(probe_every=3).resolved_probe_every == 3
    run = {"model": {"path": "m"}, "rollout": {"prompts_per_iter": 16}, "trainer": {"device": "cuda"}}
    assert to_verl(run).emapg["probe_every"] == PROBE_EVERY and to_verl(run).emapg["probe_size"] == 16
    assert to_verl({**run, "trainer": {"device": "cuda", "probe_every": 0}}).emapg["probe_every"] == 0
    assert to_verl({**run, "rollout": {"prompts_per_iter": 4}}).emapg["probe_size"] == 4  # null: capped
    with pytest.raises(ValueError, match=r"trainer\.probe_size=8 > rollout\.prompts_per_iter=4.*allowed: 1\.\.4"):
        to_verl({**run, "rollout": {"prompts_per_iter": 4}, "trainer": {"device": "cuda", "probe_size": 8}})
    off = {**run, "rollout": {"prompts_per_iter": 4}, "trainer": {"device": "cuda", "probe_every": 0}}
    assert to_verl(off).emapg["probe_every"] == 0


@pytest.mark.parametrize(
    "kl_type,tail", [("topk_reverse", "unbiased"), ("topk_reverse", "paper"), ("topk_forward", "paper"),
                     ("k3", "unbiased"), ("k4", "unbiased"), ("exact_forward", "unbiased")],
)  # fmt: skip
def test_probe_scores_from_logits_equal_the_direct_computation(tmp_path, kl_type, tail):
    """The verl probe's per-sequence scoring (from both models' logits) against the same direct computation."""
    from ema_pg_core.telemetry import probe_scores_from_logits

    tr = _trainer(tmp_path, kl_type, tail=tail)
    probe = make_probe(tr)
    kl = tr.cfg.algo.kl
    z, zr, mask, est = _direct_estimate(tr, probe, kl)
    batch = probe_batch(probe, "cpu")
    iw = ImportanceWeight(True, kl.iw_clip_low, kl.iw_clip_high)
    with torch.no_grad():
        got = probe_scores_from_logits(
            z, zr, batch.tokens, name=kl.type, k=kl.k, tail=kl.tail, iw=iw, probe_logp=probe["logp"]
        )
    direction = "forward" if kl_type in ("topk_forward", "exact_forward") else "reverse"
    m = mask.bool()
    torch.testing.assert_close(got["exact"][m], _direct_kl(z, zr, direction)[m], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(got["estimate"][m], est[m], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(got["logp"][m], torch.log_softmax(z, -1).gather(-1, batch.tokens[..., None])[..., 0][m])
