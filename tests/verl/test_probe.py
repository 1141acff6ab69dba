"""The KL probe on the verl backend (``experiments.backends.verl.probe``) through the worker's RPC methods on real CPU
FSDP2 engines (fp32; the worker built outside Ray as in test_worker_checkpoint):

- ``capture_probe`` keeps the sequences and the policy's log-probs of them (pi_probe); after the policy moves,
  ``score_probe`` gives ``kl/exact`` equal to a direct full-softmax computation on plain HF copies of both
  models, and ``kl/estimate_on_probe`` equal to the estimator applied to the same tokens with the importance
  weight pi / pi_probe, aggregated over the response mask as the loss (a masked-out response is left out);
- the probe goes into the checkpoint and comes back with it: a resumed worker scores the same tokens against the
  same pi_probe, and a capture after the load keeps the loaded probe;
- ``pick`` and ``chunks``: which responses form the probe, and the memory budget's grouping.
"""

import engines
import pytest
import torch

pytestmark = pytest.mark.verl

T = 0.7  # the rollout temperature


def _worker(tiny_path, kl_type="topk_reverse", tail="unbiased", agg="token-mean"):
    from ema_pg_core.config import AnchorConfig, KLConfig, LossConfig
    from experiments.backends.verl.config import EmaPGSection

    kl = KLConfig(type=kl_type, k=8, tail=tail, coef=0.1)
    section = EmaPGSection(kl=kl, anchor=AnchorConfig(tau=0.9, period=10), loss=LossConfig(agg=agg))
    return engines.emapg_worker(tiny_path, section, rollout_temperature=T)


_perturb = engines.perturb


def _logits(tiny_path, worker, padded):
    """(B, R, V) logits / T of a plain HF copy of ``worker``'s model (one unpadded forward per sequence)."""
    m = engines.plain_model(tiny_path)
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in worker.engine.module.state_dict().items()
    }
    m.load_state_dict(full, strict=False)
    with torch.no_grad():
        return engines.naive_logits(m.eval(), padded, T)


def _direct(kl, z, zr, tokens, probe_logp):
    """(exact, estimate) (B, R) from full logits, without the chunked paths."""
    from ema_pg_core.kl import ImportanceWeight, KLInputs, get_estimator, kl_per_token

    lp, lr = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    forward = get_estimator(kl.type).direction == "forward"
    a, b = (lr, lp) if forward else (lp, lr)
    exact = (a.exp() * (a - b)).sum(-1)
    idx = torch.topk(zr if forward else z, kl.k, -1).indices
    x = KLInputs(
        logp=lp.gather(-1, tokens[..., None])[..., 0], ref_logp=lr.gather(-1, tokens[..., None])[..., 0],
        old_logp=probe_logp, sampled=tokens, topk_idx=idx, logits_k=z.gather(-1, idx), lse=torch.logsumexp(z, -1),
        ref_logits_k=zr.gather(-1, idx), ref_lse=torch.logsumexp(zr, -1),
    )  # fmt: skip
    iw = ImportanceWeight(True, kl.iw_clip_low, kl.iw_clip_high)
    return exact, kl_per_token(kl.type, x, tail=kl.tail, iw=iw)


@pytest.mark.parametrize(
    "kl_type,tail,agg",
    [("topk_reverse", "unbiased", "token-mean"), ("topk_reverse", "paper", "seq-mean-token-mean"),
     ("topk_forward", "paper", "token-mean"), ("k3", "unbiased", "token-mean"),
     ("k4", "unbiased", "seq-mean-token-sum")],
)  # fmt: skip
def test_probe_equals_a_direct_computation_after_the_policy_moved(tiny_path, kl_type, tail, agg):
    from ema_pg_core.kl import aggregate
    from ema_pg_core.telemetry import PROBE_KEYS

    w = _worker(tiny_path, kl_type, tail, agg)
    _perturb(w.ref.engine.module, 0.05, seed=1)  # an anchor away from the policy
    td, padded = engines.batch(temperature=T, drop=(1,))  # response 1 masked out: not in the aggregate
    tokens, mask = padded["responses"], padded["response_mask"].to(torch.float32)
    z0 = _logits(tiny_path, w.actor, padded)
    assert w.capture_probe(td) == 4
    probe_logp = torch.log_softmax(z0, -1).gather(-1, tokens[..., None])[..., 0]
    for i, lp in enumerate(w._probe["logp"]):  # pi_probe: the capturing policy's log-probs of the response tokens
        torch.testing.assert_close(lp, probe_logp[i, : len(lp)], atol=2e-5, rtol=1e-5)

    _perturb(w.actor.engine.module, 0.05, seed=2)  # the policy moves: the importance weight is no longer 1
    m = w.score_probe()
    z, zr = _logits(tiny_path, w.actor, padded), _logits(tiny_path, w.ref, padded)
    exact, estimate = _direct(w._emapg.kl, z, zr, tokens, probe_logp)
    want_exact, want_est = aggregate(exact, mask, agg).item(), aggregate(estimate, mask, agg).item()
    assert sorted(m) == sorted(PROBE_KEYS)
    assert m["kl/exact"] == pytest.approx(want_exact, abs=1e-5) and want_exact > 1e-3
    assert m["kl/estimate_on_probe"] == pytest.approx(want_est, abs=1e-5)
    assert m["kl/estimate_gap"] == m["kl/estimate_on_probe"] - m["kl/exact"]
    unmasked = aggregate(exact, torch.ones_like(mask) * (padded["attention_mask"][:, engines.P :] > 0), agg).item()
    assert abs(unmasked - want_exact) > 1e-4  # the masked response would have changed the value


def test_the_probe_travels_with_the_checkpoint(tiny_path, tmp_path):
    from experiments.backends.verl.probe import PROBE_FILE

    w = _worker(tiny_path)
    _perturb(w.ref.engine.module, 0.05, seed=1)
    w.capture_probe(engines.batch(temperature=T)[0])
    _perturb(w.actor.engine.module, 0.05, seed=2)
    before = w.score_probe()
    step = tmp_path / "global_step_3"
    w.save_checkpoint(str(step / "actor"), None, 3, None)
    assert (step / PROBE_FILE).is_file()

    w2 = _worker(tiny_path)
    w2.load_checkpoint(str(step / "actor"))
    assert w2.capture_probe(engines.batch(seed=5, temperature=T)[0]) == 4  # the loaded probe is kept
    assert torch.equal(w2._probe["data"]["input_ids"].values(), w._probe["data"]["input_ids"].values())
    assert all(torch.equal(a, b) for a, b in zip(w2._probe["logp"], w._probe["logp"]))
    assert w2.score_probe() == pytest.approx(before, abs=1e-6)


def test_score_before_capture_is_an_error(tiny_path):
    with pytest.raises(RuntimeError, match="score_probe before capture_probe"):
        _worker(tiny_path).score_probe()


def test_pick_takes_the_first_response_of_each_prompt_and_skips_padding():
    from experiments.backends.verl.probe import pick

    uids = ["a", "a", "x", "b", "c", "b", "d"]
    tags = [{}, {}, {"is_padding": True}, {}, {}, {}, {}]
    assert pick(uids, tags, 3) == [0, 3, 4]
    assert pick(uids, tags, 10) == [0, 3, 4, 6]


def test_chunks_keep_each_group_within_the_budget():
    from experiments.backends.verl.probe import chunks

    assert chunks([3, 3, 3, 3], vocab=10, budget=3 * 10 * 4 * 2) == [[0, 1], [2, 3]]
    assert chunks([50, 1, 1], vocab=10, budget=100) == [[0], [1, 2]]  # one sequence over the budget: alone
    assert chunks([], vocab=10) == []
