"""The CUDA paths against their CPU references (marked ``gpu``; ``make test-gpu`` runs them on any CUDA machine).

Needs torch and one CUDA device; no verl, no internet. Each test records what it measured
(``record_property``); ``tests/run_gpu.py`` prints those figures with the card's name.

- The fused Top-k (``token_stats_from_hidden``, blocked over positions and vocabulary) on CUDA:
  - float64 against the naive float64 computation on the CPU: the same own-top-k indices, values and
    gradients to 1e-10 (the CPU test's bound; only summation order differs);
  - float32 at the Qwen2 vocabulary (V = 151,936, blocks of 16,384 columns) against the float64 truth: every
    gradient within 1e-5 of it relative to its max-abs, the bound the CPU float32 test uses (``test_fused``).
- The EMA update (``ema_update_``: ``_foreach_lerp_`` for equal dtypes, slice-wise casts otherwise; the fp32
  shadow of ``EmaAnchor``) on CUDA against the same update on the CPU: at most 1 ulp of the anchor's dtype
  apart (CUDA contracts lerp's multiply-add into one FMA, the CPU kernels may round twice), after 20 updates.
- ``wait_for_offload`` after verl's offload (``module.to("cpu", non_blocking=True)``) behind queued device work:
  the EMA read from the host copies equals the EMA of the weights as they were on the device, and without the
  wait it does not (the check can fail).
"""

import pytest
import torch

from ema_pg_core import anchor as anchor_mod
from ema_pg_core.anchor import EmaAnchor, ema_update_
from ema_pg_core.config import AnchorConfig
from ema_pg_core.kl import ImportanceWeight, kl_per_token
from ema_pg_core.topk import kl_inputs, token_stats_from_hidden
from experiments.backends.verl.ema import ema_update_sharded_, wait_for_offload
from tests.core.test_fused import FP32_REL_TOL, make_models, naive_stats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


# ------------------------------------------------------------------ fused Top-k
def _topk_kl(stats_fn, anchor, tok, old_logp, w, direction, tail):
    """sum_t w_t * TopkKL_t from the policy's stats; its value."""
    kl = kl_per_token(
        f"topk_{direction}",
        kl_inputs(stats_fn(), anchor, tok, old_logp),
        tail=tail,
        iw=ImportanceWeight(enabled=old_logp is not None),
    )
    return (w * kl).sum()


def _problem(B, T, V, H, K, seed, temperature):
    """One problem in float64 on the CPU: policy (h, W, b), tokens, pi_old's top-k, the anchor's stats there,
    pi_old's logp, token weights. Every dtype and device below is a cast of it (the same indices everywhere)."""
    h, W, b, (Wr, br), (Wo, bo), tok = make_models(B, T, V, H, torch.float64, seed)
    with torch.no_grad():
        idx = naive_stats(h, Wo, bo, tok, k=K, temperature=temperature).indices
        anchor = naive_stats(h, Wr, br, tok, indices=idx, temperature=temperature)
        old_logp = naive_stats(h, Wo, bo, tok, indices=idx, temperature=temperature).logp
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return (h.detach(), W.detach(), b.detach()), anchor, (tok, idx, old_logp, w)


def _cast(problem, dtype, device):
    """The problem's tensors on ``device``, floating ones in ``dtype``; (h, W, b) as fresh leaves with grad."""
    leaves, anchor, rest = problem
    put = lambda t: None if t is None else t.to(device, dtype if t.is_floating_point() else t.dtype)
    anchor = type(anchor)(*(put(f) for f in vars(anchor).values()))
    return [put(t).requires_grad_(True) for t in leaves], anchor, [put(t) for t in rest]


@pytest.mark.parametrize("tail", ["paper", "unbiased"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_fused_topk_on_cuda_float64_equals_the_cpu_naive_computation(direction, tail, record_property):
    K, temp = 6, 0.7
    problem = _problem(B=2, T=9, V=97, H=8, K=K, seed=21, temperature=temp)
    (h, W, b), anchor, (tok, idx, old, w) = _cast(problem, torch.float64, CUDA)
    (hc, Wc, bc), anchor_c, (tok_c, idx_c, old_c, w_c) = _cast(problem, torch.float64, torch.device("cpu"))
    blocked = dict(chunk_size=4, vocab_chunk_size=16, temperature=temp)
    fused = token_stats_from_hidden(h, W, b, tok, k=K, entropy=True, **blocked)
    naive = naive_stats(hc, Wc, bc, tok_c, k=K, temperature=temp)
    assert torch.equal(fused.indices.cpu(), naive.indices)
    errs = {n: (getattr(fused, n).cpu() - getattr(naive, n)).abs().max().item() for n in ("logp", "lse", "logits_k")}
    value = _topk_kl(
        lambda: token_stats_from_hidden(h, W, b, tok, indices=idx, **blocked), anchor, tok, old, w, direction, tail
    )
    ref = _topk_kl(
        lambda: naive_stats(hc, Wc, bc, tok_c, indices=idx_c, temperature=temp),
        anchor_c,
        tok_c,
        old_c,
        w_c,
        direction,
        tail,
    )
    errs["kl"] = (value.cpu() - ref).abs().item()
    for name, g, gc in zip("hWb", torch.autograd.grad(value, (h, W, b)), torch.autograd.grad(ref, (hc, Wc, bc))):
        errs[f"d/d{name}"] = (g.cpu() - gc).abs().max().item()
    record_property("max abs error, float64", f"{max(errs.values()):.1e}")
    assert max(errs.values()) < 1e-10, errs


def fp32_qwen2_errors(direction: str, device: torch.device) -> dict[str, float]:
    """Relative max errors of the fused float32 gradients on ``device`` against the float64 naive truth."""
    problem = _problem(B=2, T=64, V=151_936, H=64, K=32, seed=5, temperature=1.0)
    (h, W, b), anchor, (tok, idx, old, w) = _cast(problem, torch.float32, device)
    blocked = dict(chunk_size=64, vocab_chunk_size=16_384)
    value = _topk_kl(
        lambda: token_stats_from_hidden(h, W, b, tok, indices=idx, **blocked), anchor, tok, old, w, direction, "paper"
    )
    grads = torch.autograd.grad(value, (h, W, b))
    (hc, Wc, bc), anchor_c, (tok_c, idx_c, old_c, w_c) = _cast(problem, torch.float64, torch.device("cpu"))
    ref = _topk_kl(
        lambda: naive_stats(hc, Wc, bc, tok_c, indices=idx_c), anchor_c, tok_c, old_c, w_c, direction, "paper"
    )
    truths = torch.autograd.grad(ref, (hc, Wc, bc))
    return {
        f"d/d{n}": ((g.cpu().double() - t).abs().max() / t.abs().max()).item() for n, g, t in zip("hWb", grads, truths)
    }


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_fused_topk_on_cuda_float32_at_the_qwen2_vocabulary(direction, record_property):
    """float32 CUDA gradients (fused, blocks of 16,384 columns) against the float64 naive truth on the CPU."""
    errs = fp32_qwen2_errors(direction, CUDA)
    record_property("max error / max-abs, float32", f"{max(errs.values()):.1e} (bound {FP32_REL_TOL:.0e})")
    assert max(errs.values()) < FP32_REL_TOL, errs


# ------------------------------------------------------------------ EMA update
def _ulps(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - ref| in units in the last place of ``ref``'s dtype at ``ref`` (both on the CPU)."""
    _, e = torch.frexp(ref.double())
    ulp = torch.finfo(ref.dtype).eps * torch.pow(2.0, (e - 1).double())
    return (x.double() - ref.double()).abs() / ulp


def _tensors(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


SHAPES = [(1024, 513), (3, 5), (4096,), (1 << 20,)]
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("anchor_dtype,policy_dtype", PAIRS)
def test_ema_update_on_cuda_is_within_one_ulp_of_the_cpu_update(anchor_dtype, policy_dtype, record_property):
    """20 updates (tau = 0.9), each from the CPU's anchor: the per-update difference, not a compounded one."""
    cpu_a, ulps = _tensors(SHAPES, anchor_dtype, 0), []
    for step in range(20):
        policy, gpu_a = _tensors(SHAPES, policy_dtype, 100 + step), [t.to(CUDA, copy=True) for t in cpu_a]
        ema_update_(cpu_a, policy, 0.9)
        ema_update_(gpu_a, [p.to(CUDA) for p in policy], 0.9)
        ulps.append(torch.cat([_ulps(g.cpu(), c).flatten() for g, c in zip(gpu_a, cpu_a)]))
    ulps = torch.cat(ulps)
    record_property("identical to the CPU", f"{(ulps == 0).double().mean().item():.4%}")
    record_property("max ulps", f"{ulps.max().item():g}")
    assert ulps.max() <= 1


def test_the_fp32_shadow_anchor_on_cuda_is_within_one_ulp_of_the_cpu_anchor(record_property, monkeypatch):
    """A bf16 policy and anchor with an fp32 shadow (``algo.anchor.fp32_shadow``), tau = 0.99: 20 updates, each
    from the CPU anchor's shadow; the mixed-precision update in several slices on both devices."""
    monkeypatch.setattr(anchor_mod, "SLICE", 10_000)
    monkeypatch.setattr(anchor_mod, "DEVICE_SLICE", 30_000)
    policy = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512)).bfloat16()
    cpu, gpu = (
        EmaAnchor(policy, AnchorConfig(0.99, 1, fp32_shadow=True)),
        EmaAnchor(policy.to(CUDA), AnchorConfig(0.99, 1, fp32_shadow=True)),
    )
    policy.cpu()
    g, shadow, module = torch.Generator().manual_seed(7), [], []
    for it in range(1, 21):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g).bfloat16())
        gpu.shadow = [t.to(CUDA, copy=True) for t in cpu.shadow]
        assert cpu.update(it, policy) and gpu.update(it, policy.to(CUDA))
        policy.cpu()
        shadow += [_ulps(a.cpu(), c).flatten() for a, c in zip(gpu.shadow, cpu.shadow)]
        module += [_ulps(a.cpu(), c).flatten() for a, c in zip(gpu.module.parameters(), cpu.module.parameters())]
    shadow, module = torch.cat(shadow), torch.cat(module)
    record_property("max ulps (fp32 shadow, bf16 anchor)", f"{shadow.max().item():g}, {module.max().item():g}")
    assert shadow.max() <= 1 and module.max() <= 1


# ------------------------------------------------------------------ verl's offload, then the EMA on the host
def _offloaded_ema(wait: bool, seed: int) -> list[bool]:
    """verl's actor offload, [``wait_for_offload``], the EMA into a host anchor: per tensor, is it the EMA of the
    weights as they were on the device?"""
    torch.manual_seed(seed)
    actor = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)]).to(CUDA)  # 67M parameters
    anchor = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)])  # on the host, as verl's ref
    with torch.no_grad():
        for p in actor.parameters():
            p.mul_(3.0).add_(1.0)
    on_device = [p.detach().clone() for p in actor.parameters()]
    before = [p.detach().clone() for p in anchor.parameters()]
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device work queued before the offload, as an optimizer step's
    actor.to("cpu", non_blocking=True)  # verl.utils.fsdp_utils.offload_fsdp2_model_to_cpu
    if wait:
        wait_for_offload()
    ema_update_sharded_(anchor, actor, 0.9)
    want = [torch.lerp(b, p.cpu(), 0.1) for b, p in zip(before, on_device)]
    return [torch.allclose(a, w, rtol=1e-6, atol=1e-6) for a, w in zip(anchor.parameters(), want)]


def test_the_anchor_after_an_offloaded_update_is_the_ema_of_the_on_device_weights(record_property):
    """With device work still queued when verl offloads, the host copies are not there yet: the update without
    the wait reads other values (the check can fail), the update after ``wait_for_offload`` is exact. The
    negative case runs first, with its own seed: pinned host blocks are cached and reused, and a block that
    still held the same weights from an earlier offload would hide the race."""
    wrong = _offloaded_ema(wait=False, seed=1).count(False)
    record_property("tensors wrong without the wait", f"{wrong} of 32")
    assert wrong > 0
    assert all(_offloaded_ema(wait=True, seed=0))
