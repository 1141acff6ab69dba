"""The fused Top-k path (issue 7), blocked over positions AND vocabulary, against the naive one.

Naive: materialise logits = h W^T + b (N, V), log-softmax, gather; autograd does the rest.
Fused: ``token_stats_from_hidden(..., chunk_size=n, vocab_chunk_size=v)`` never holds more than
(n, v) logits, merges the logsumexp / entropy / own top-k online across vocabulary blocks and
recomputes every block in its backward. The Top-k KL built from either must have the same value
and the same gradient w.r.t. h, W and b, for both directions, every tail mode, with and without
temperature and the importance weight s = sg(pi / pi_old).

Tolerances: float64 to 1e-10 (absolute; gradients are O(1)). float32, medium size (N=512,
H=64, V=5000, K=32): both the fused and the naive float32 gradients are compared with the
float64 naive gradient, and each must be within 1e-5 of it relative to the gradient's max-abs
(measured over the 12 cases: at most 2.8e-6, for the fused and the naive path alike; the bound
leaves ~3.5x headroom for other BLAS builds).
"""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ema_pg_core.kl import ImportanceWeight, kl_per_token
from ema_pg_core.topk import TokenStats, kl_inputs, token_stats_from_hidden, token_stats_from_logits

FP32_REL_TOL = 1e-5


def naive_stats(h, W, b, tok, *, indices=None, k=0, temperature=1.0) -> TokenStats:
    """Reference: full (B, T, V) logits and log-softmax; differentiable through autograd."""
    z = torch.nn.functional.linear(h, W, b) / temperature
    logsm = torch.log_softmax(z, -1)
    idx = torch.topk(z, k, -1).indices if indices is None else indices
    ent = -(logsm.exp() * logsm).sum(-1)
    return TokenStats(logsm.gather(-1, tok[..., None])[..., 0], torch.logsumexp(z, -1), z.gather(-1, idx), idx, ent)


def make_models(B, T, V, H, dtype, seed):
    """Policy (h, W, b) with grad; anchor and pi_old heads near the policy; sampled tokens.

    Drawn in float64 and cast, so that the float32 and float64 cases are the same problem.
    """
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    h = torch.randn(B, T, H, generator=g, dtype=f64)
    W, b = torch.randn(V, H, generator=g, dtype=f64) / H**0.5, 0.5 * torch.randn(V, generator=g, dtype=f64)
    Wr, br = (
        W + 0.3 * torch.randn(V, H, generator=g, dtype=f64) / H**0.5,
        b + 0.1 * torch.randn(V, generator=g, dtype=f64),
    )
    Wo = W + 0.2 * torch.randn(V, H, generator=g, dtype=f64) / H**0.5
    tok = torch.randint(V, (B, T), generator=g)
    h, W, b = (t.to(dtype).requires_grad_(True) for t in (h, W, b))
    return h, W, b, (Wr.to(dtype), br.to(dtype)), (Wo.to(dtype), b.detach()), tok


@functools.lru_cache(maxsize=8)
def _case(direction, temperature, use_iw, B, T, V, H, K, dtype, seed):
    """Models, head indices q, the anchor's stats at q, old_logp and token weights (shared by the tails)."""
    h, W, b, (Wr, br), (Wo, bo), tok = make_models(B, T, V, H, dtype, seed)
    hd = h.detach()
    with torch.no_grad():  # q: pi_old's top-k (reverse) or the anchor's (forward), both in f64
        src = (Wo, bo) if direction == "reverse" else (Wr, br)
        idx = naive_stats(hd.double(), src[0].double(), src[1].double(), tok, k=K, temperature=temperature).indices
        anchor = naive_stats(hd, Wr, br, tok, indices=idx, temperature=temperature)
        old_logp = naive_stats(hd, Wo, bo, tok, indices=idx, temperature=temperature).logp if use_iw else None
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
    return h, W, b, tok, idx, anchor, old_logp, w


def kl_grads(direction, tail, temperature, use_iw, *, B, T, V, H, K, dtype, chunk, vchunk, seed=0, fused=True):
    """((value, grads) fused or None, (value, grads) naive) of sum_t w_t * TopkKL_t; grads w.r.t. (h, W, b)."""
    h, W, b, tok, idx, anchor, old_logp, w = _case(direction, temperature, use_iw, B, T, V, H, K, dtype, seed)
    iw = ImportanceWeight(enabled=use_iw)

    def run(stats_fn):
        pol = stats_fn()
        kl = kl_per_token(f"topk_{direction}", kl_inputs(pol, anchor, tok, old_logp), tail=tail, iw=iw)
        loss = (w * kl).sum()
        return loss.detach(), torch.autograd.grad(loss, (h, W, b))

    fused = fused and run(
        lambda: token_stats_from_hidden(
            h, W, b, tok, indices=idx, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vchunk
        )
    )
    naive = run(lambda: naive_stats(h, W, b, tok, indices=idx, temperature=temperature))
    return fused, naive


CASES = [
    (d, t, temp, iw)
    for d in ("reverse", "forward")
    for t in ("paper", "unbiased", "none")
    for temp in (1.0, 0.7)
    for iw in (False, True)
]


@pytest.mark.parametrize("direction,tail,temperature,use_iw", CASES)
def test_fused_topk_kl_gradients_equal_naive_float64(direction, tail, temperature, use_iw):
    # V=23 in vocabulary blocks of 5 (the last block has 3 columns), K=6 > 5 so heads span blocks
    (vf, gf), (vn, gn) = kl_grads(
        direction, tail, temperature, use_iw, B=2, T=7, V=23, H=6, K=6, dtype=torch.float64, chunk=3, vchunk=5
    )
    assert torch.allclose(vf, vn, atol=1e-10, rtol=0)
    for name, a, c in zip(("h", "W", "b"), gf, gn):
        assert (a - c).abs().max() < 1e-10, (name, (a - c).abs().max().item())


# float32: temperature and the importance weight are switched together (the float64 test crosses them)
MEDIUM = [
    (d, t, temp, iw)
    for d in ("reverse", "forward")
    for temp, iw in ((1.0, False), (0.7, True))
    for t in ("paper", "unbiased", "none")
]


@pytest.mark.parametrize("direction,tail,temperature,use_iw", MEDIUM)
def test_fused_topk_kl_gradients_float32_medium(direction, tail, temperature, use_iw):
    kw = dict(B=4, T=128, V=5000, H=64, K=32, chunk=128, vchunk=1024, seed=3)
    (_, g32), (_, n32) = kl_grads(direction, tail, temperature, use_iw, dtype=torch.float32, **kw)
    _, (_, g64) = kl_grads(direction, tail, temperature, use_iw, dtype=torch.float64, fused=False, **kw)
    for name, fused, naive, truth in zip(("h", "W", "b"), g32, n32, g64):
        scale = truth.abs().max()
        err_fused = (fused.double() - truth).abs().max() / scale
        err_naive = (naive.double() - truth).abs().max() / scale
        assert err_fused < FP32_REL_TOL and err_naive < FP32_REL_TOL, (name, err_fused.item(), err_naive.item())


# --------------------------------------------------------------------------------------
# Every statistic, blocked over the vocabulary, against the unblocked / naive computation
# --------------------------------------------------------------------------------------
BLOCKS = [(2, 1), (3, 4), (4, 7), (16, 23), (16, 1000), (2, None)]


@pytest.mark.parametrize("chunk,vchunk", BLOCKS)
@pytest.mark.parametrize("own_topk", [True, False])
def test_blocked_stats_values_and_gradients(chunk, vchunk, own_topk):
    """logp, lse, logits_k, indices, entropy and d(any linear functional)/d(h, W, b) match naive."""
    h, W, b, _, _, tok = make_models(2, 7, 23, 6, torch.float64, seed=11)
    stored = None if own_topk else torch.randint(23, (2, 7, 9), generator=torch.Generator().manual_seed(2))
    kw = dict(indices=stored, k=9 if own_topk else 0, temperature=1.3)
    fast = token_stats_from_hidden(h, W, b, tok, chunk_size=chunk, vocab_chunk_size=vchunk, entropy=True, **kw)
    slow = naive_stats(h, W, b, tok, **kw)
    assert torch.equal(fast.indices, slow.indices)
    g = torch.Generator().manual_seed(5)
    outs = []
    for st in (fast, slow):
        parts = (st.logp, st.lse, st.logits_k, st.entropy)
        outs.append(parts)
    for a, c in zip(*outs):
        assert torch.allclose(a, c, atol=1e-12, rtol=0)
    w = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in outs[1]]
    gf = torch.autograd.grad(sum((wi * t).sum() for wi, t in zip(w, outs[0])), (h, W, b))
    gn = torch.autograd.grad(sum((wi * t).sum() for wi, t in zip(w, outs[1])), (h, W, b))
    for a, c in zip(gf, gn):
        assert (a - c).abs().max() < 1e-10


@pytest.mark.parametrize("vchunk", [1, 5, None])
def test_logits_path_blocked_over_vocabulary(vchunk):
    h, W, b, _, _, tok = make_models(2, 7, 23, 6, torch.float64, seed=12)
    logits = torch.nn.functional.linear(h, W, b).detach().requires_grad_(True)
    fast = token_stats_from_logits(
        logits, tok, k=4, chunk_size=7, vocab_chunk_size=vchunk, entropy=True, temperature=0.8
    )
    slow = naive_stats(h.detach(), W.detach(), b.detach(), tok, k=4, temperature=0.8)
    assert torch.equal(fast.indices, slow.indices)
    for a, c in (
        (fast.logp, slow.logp),
        (fast.lse, slow.lse),
        (fast.logits_k, slow.logits_k),
        (fast.entropy, slow.entropy),
    ):
        assert torch.allclose(a, c, atol=1e-12, rtol=0)
    (g,) = torch.autograd.grad(fast.logp.sum() + fast.entropy.sum() + fast.logits_k.sum(), logits)
    z = logits / 0.8
    lsm = torch.log_softmax(z, -1)
    ref = lsm.gather(-1, tok[..., None]).sum() - (lsm.exp() * lsm).sum() + z.gather(-1, fast.indices).sum()
    (gr,) = torch.autograd.grad(ref, logits)
    assert (g - gr).abs().max() < 1e-10


def test_one_vocabulary_block_is_the_unblocked_computation():
    """vocab_chunk_size >= V (or None) reproduces the unblocked numbers bit for bit."""
    h, W, b, _, _, tok = make_models(2, 7, 23, 6, torch.float32, seed=13)
    a = token_stats_from_hidden(h, W, b, tok, k=5, chunk_size=4, entropy=True)
    c = token_stats_from_hidden(h, W, b, tok, k=5, chunk_size=4, entropy=True, vocab_chunk_size=23)
    for x, y in zip(
        (a.logp, a.lse, a.logits_k, a.indices, a.entropy), (c.logp, c.lse, c.logits_k, c.indices, c.entropy)
    ):
        assert torch.equal(x, y)


def test_bf16_blocked_accumulates_in_fp32():
    h, W, b, _, _, tok = make_models(2, 7, 23, 6, torch.float32, seed=14)
    hb, Wb = h.detach().bfloat16().requires_grad_(True), W.detach().bfloat16().requires_grad_(True)
    st = token_stats_from_hidden(hb, Wb, None, tok, k=3, vocab_chunk_size=4, chunk_size=5)
    ref = torch.logsumexp((hb @ Wb.T).float(), -1)
    assert st.lse.dtype == torch.float32 and torch.allclose(st.lse, ref, atol=1e-5)
    gh, gw = torch.autograd.grad(st.lse.sum() + st.logp.sum(), (hb, Wb))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.shape = t.numel(), tuple(t.shape)
        return out


def test_fused_never_builds_more_than_a_block_of_logits():
    """N*V = 19,200; the largest tensor of forward + backward is the (V, H) weight gradient."""
    N, V, H, K, chunk, vchunk = 32, 600, 4, 8, 16, 100
    h, W, b, _, _, tok = make_models(1, N, V, H, torch.float32, seed=15)
    with _MaxNumel() as m:
        st = token_stats_from_hidden(h, W, b, tok, k=K, chunk_size=chunk, vocab_chunk_size=vchunk, entropy=True)
        torch.autograd.grad(st.lse.sum() + st.logits_k.sum() + st.entropy.sum() + st.logp.sum(), (h, W, b))
    assert m.max_numel <= max(V * H, chunk * vchunk), (m.max_numel, m.shape)


def test_bad_vocab_chunk_and_out_of_range_tokens():
    h, W, b, _, _, tok = make_models(2, 7, 23, 6, torch.float64, seed=16)
    with pytest.raises(ValueError, match="vocab_chunk_size must be >= 1"):
        token_stats_from_hidden(h, W, b, tok, k=2, vocab_chunk_size=0)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, V\)"):
        token_stats_from_hidden(h, W, b, tok + 23, k=2)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, V\)"):
        token_stats_from_hidden(h, W, b, tok, indices=torch.full((2, 7, 3), -1))


# --------------------------------------------------------------------------------------
# Issue 7, part 3: the EMA update's mixed-precision path runs over cache-sized slices
# --------------------------------------------------------------------------------------
def test_ema_sliced_mixed_precision_update_equals_cast_then_lerp(monkeypatch):
    """fp32 shadow <- lerp(shadow, bf16 policy); bf16 module <- shadow, bit for bit as the whole-tensor cast."""
    from ema_pg_core import anchor as anchor_mod

    monkeypatch.setattr(anchor_mod, "SLICE", 7)  # several slices, a ragged last one
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 9), (13,), (4, 4)]
    f32 = torch.float32  # explicit: test_kl.py sets the default dtype to float64
    policy = [torch.randn(s, generator=g, dtype=f32).bfloat16() for s in shapes]
    policy.append(torch.randn(6, 3, generator=g, dtype=f32).bfloat16().T)  # non-contiguous: whole-tensor fallback
    shadow = [torch.randn(p.shape, generator=g, dtype=f32) for p in policy]
    module = [s.bfloat16() for s in shadow]
    want_shadow = [s.lerp(p.float(), 0.1) for s, p in zip(shadow, policy)]
    anchor_mod._shadow_update_(shadow, module, policy, tau=0.9)
    for s, m, w in zip(shadow, module, want_shadow):
        assert torch.equal(s, w) and torch.equal(m, w.bfloat16())
    same = [t.clone() for t in shadow]
    anchor_mod.ema_update_(same, policy, 0.5)  # mixed pairs go through the same sliced cast
    for t, s, p in zip(same, shadow, policy):
        assert torch.equal(t, s.lerp(p.float(), 0.5))
    with pytest.raises(ValueError, match="shape"):
        anchor_mod.ema_update_([torch.zeros(2, 3, dtype=f32)], [torch.zeros(3, 2, dtype=torch.bfloat16)], 0.5)
