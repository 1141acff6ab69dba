"""Chunked / fused Top-k statistics against the naive full computation, values and gradients."""

import pytest
import torch

from ema_pg_core.kl import kl_per_token
from ema_pg_core.topk import kl_inputs, token_stats_from_hidden, token_stats_from_logits, topk_ids_from_logits


def naive(logits, tokens, k=0, indices=None, temperature=1.0):
    z = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    z = z / temperature
    logsm = torch.log_softmax(z, -1)
    idx = torch.topk(z, k, -1).indices if indices is None else indices
    ent = -(logsm.exp() * logsm).sum(-1)
    return logsm.gather(-1, tokens[..., None])[..., 0], torch.logsumexp(z, -1), z.gather(-1, idx), idx, ent


def rand_case(B=2, T=7, V=23, H=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_(True)
    W = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_(True)
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_(True)
    tok = torch.randint(V, (B, T), generator=g)
    return h, W, b, tok


@pytest.mark.parametrize("chunk", [1, 3, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_path_values_and_gradients_equal_naive(chunk, temperature):
    h, W, b, tok = rand_case()
    logits = (h @ W.T + b).detach().requires_grad_(True)
    st = token_stats_from_logits(logits, tok, k=5, temperature=temperature, chunk_size=chunk, entropy=True)
    logp, lse, lk, idx, ent = naive(logits, tok, k=5, temperature=temperature)
    assert torch.equal(st.indices, idx)
    for a, b_ in ((st.logp, logp), (st.lse, lse), (st.logits_k, lk), (st.entropy, ent)):
        assert torch.allclose(a, b_, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (logp, lse, lk, ent)]
    loss_fast = sum((wi * t).sum() for wi, t in zip(w, (st.logp, st.lse, st.logits_k, st.entropy)))
    loss_naive = sum((wi * t).sum() for wi, t in zip(w, (logp, lse, lk, ent)))
    (g_fast,) = torch.autograd.grad(loss_fast, logits)
    (g_naive,) = torch.autograd.grad(loss_naive, logits)
    assert torch.allclose(g_fast, g_naive, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk,vchunk", [(1024, None), (3, None), (5, 7)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_ids_are_the_stats_own_top_k(dtype, tied, chunk, vchunk, temperature):
    """The ids-only path (the verl engine's pi_old pass) picks exactly the ids of the full statistics, equal
    logits included: the tied logits take 5 values, so most heads cut through a run of equal logits."""
    g = torch.Generator().manual_seed(11)
    B, T, V = 3, 9, 40
    if tied:
        logits = torch.randint(-2, 3, (B, T, V), generator=g).to(dtype)
    else:
        logits = torch.randn(B, T, V, generator=g, dtype=torch.float64).to(dtype)
    for k in (1, 6, V):
        ids = topk_ids_from_logits(logits, k=k, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vchunk)
        st = token_stats_from_logits(logits, k=k, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vchunk)
        assert ids.dtype == torch.long and ids.shape == (B, T, k)
        assert torch.equal(ids, st.indices), k
        if tied and k < V:  # the cut falls between equal logits: which of them is kept is what is tested
            top = torch.sort(logits.float(), -1, descending=True).values
            assert bool((top[..., k - 1] == top[..., k]).any())


def test_topk_ids_validation_and_empty():
    logits = torch.randn(2, 3, 8)
    assert topk_ids_from_logits(logits, k=0).shape == (2, 3, 0)
    assert topk_ids_from_logits(torch.randn(0, 3, 8), k=2).shape == (0, 3, 2)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        topk_ids_from_logits(logits, k=9)
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        topk_ids_from_logits(logits[0], k=2)


@pytest.mark.parametrize("chunk", [2, 1024])
def test_hidden_path_gathers_at_stored_indices_with_gradients(chunk):
    h, W, b, tok = rand_case(seed=3)
    stored = torch.topk(torch.randn(2, 7, 23, generator=torch.Generator().manual_seed(9)), 4, -1).indices
    st = token_stats_from_hidden(h, W, b, tok, indices=stored, chunk_size=chunk, temperature=1.3, entropy=True)
    logits = h @ W.T + b
    logp, lse, lk, _, ent = naive(logits, tok, indices=stored, temperature=1.3)
    assert torch.equal(st.indices, stored)
    out_fast = st.logp.sum() + 2 * st.lse.sum() + (st.logits_k**2).sum() + 0.5 * st.entropy.sum()
    out_naive = logp.sum() + 2 * lse.sum() + (lk**2).sum() + 0.5 * ent.sum()
    assert torch.allclose(out_fast, out_naive, atol=1e-10)
    g_fast = torch.autograd.grad(out_fast, (h, W, b))
    g_naive = torch.autograd.grad(out_naive, (h, W, b))
    for a, c in zip(g_fast, g_naive):
        assert torch.allclose(a, c, atol=1e-10)


def test_bf16_accumulates_in_fp32():
    h, W, b, tok = rand_case(dtype=torch.float32, seed=4)
    logits = (h @ W.T).detach().to(torch.bfloat16)
    st = token_stats_from_logits(logits, tok, k=3)
    assert st.lse.dtype == torch.float32
    assert torch.allclose(st.lse, torch.logsumexp(logits.float(), -1), atol=1e-6)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("tail", ["paper", "unbiased", "none"])
def test_topk_kl_from_stats_equals_kl_from_full_logits(direction, tail):
    """Top-k KL built from chunked stats equals the same estimator on naively gathered inputs, grads too."""
    h, W, b, tok = rand_case(seed=5)
    ref = torch.randn(2, 7, 23, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    logits = h @ W.T + b
    head_src = logits.detach() if direction == "reverse" else ref
    idx = torch.topk(head_src, 6, -1).indices
    pol = token_stats_from_hidden(h, W, b, tok, indices=idx, chunk_size=3)
    anc = token_stats_from_logits(ref, tok, indices=idx)
    x = kl_inputs(pol, anc, tok)
    fast = kl_per_token(f"topk_{direction}", x, tail=tail)
    logp, lse, lk, _, _ = naive(logits, tok, indices=idx)
    rlogp, rlse, rlk, _, _ = naive(ref, tok, indices=idx)
    from ema_pg_core.kl import KLInputs

    slow = kl_per_token(
        f"topk_{direction}",
        KLInputs(
            logp=logp, ref_logp=rlogp, sampled=tok, topk_idx=idx, logits_k=lk, lse=lse, ref_logits_k=rlk, ref_lse=rlse
        ),
        tail=tail,
    )
    assert torch.allclose(fast, slow, atol=1e-12)
    gf = torch.autograd.grad(fast.sum(), (h, W, b))
    gs = torch.autograd.grad(slow.sum(), (h, W, b))
    for a, c in zip(gf, gs):
        assert torch.allclose(a, c, atol=1e-10)


def test_bad_inputs():
    h, W, b, tok = rand_case()
    with pytest.raises(ValueError, match="k=99 exceeds the vocabulary size V=23"):
        token_stats_from_logits(h @ W.T, tok, k=99)
    with pytest.raises(ValueError, match="tokens has shape"):
        token_stats_from_logits(h @ W.T, tok[:, :3], k=2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_stats_from_logits(h @ W.T, tok, k=2, temperature=0.0)
    with pytest.raises(ValueError, match=r"hidden must be \(B, T, H\)"):
        token_stats_from_hidden(h, W[:, :2], None, tok, k=2)
    with pytest.raises(ValueError, match=r"logits must be \(B, T, V\)"):
        token_stats_from_logits(W, tok, k=2)
