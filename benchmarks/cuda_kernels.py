"""The EMA update and the Top-k KL on one CUDA GPU: time and peak device memory, as ratios to baselines.

    python benchmarks/cuda_kernels.py --json /tmp/cuda_kernels.json   # on a GPU machine: measure
    python benchmarks/cuda_kernels.py --from-json benchmarks/cuda_kernels_h200.json   # anywhere: write the doc

The problems of ``ema_update.py`` and ``topk_kl_memory.py`` on the device: the EMA update against
``_foreach_copy_`` of the same tensors (median of 20 interleaved rounds), and the Top-k KL value + backward at k = 32
(median of 5, peak device memory above the inputs).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402
from benchmarks.ema_update import TAU, policy_and_anchor  # noqa: E402
from benchmarks.topk_kl_memory import make_inputs, value_and_backward  # noqa: E402
from ema_pg_core.anchor import ema_update_  # noqa: E402
from ema_pg_core.topk import TokenStats  # noqa: E402

SECTION = "EMA update and Top-k KL on a GPU"
TOPK_VARIANTS = ["naive_topk", "chunked_topk", "fused_topk", "fused_topk_wholeV"]
NS = [4096, 16384]


def _ema_group(shadow: bool, reps: int) -> list[dict]:
    """Copy, then the update, of the same tensors: median ms, GB/s, ratio to the copy."""
    policy, anchor, pol, anc = policy_and_anchor(shadow, "cuda")
    n, size, name = sum(p.numel() for p in pol), pol[0].element_size(), str(pol[0].dtype)[6:]
    fns = {f"copy ({name}, _foreach_copy_)": (lambda: torch._foreach_copy_(anc, pol), 2 * size * n)}
    if shadow:
        fns["EmaAnchor.update (bf16 module + fp32 shadow)"] = (lambda: anchor.update(1, policy), 16 * n)
    else:
        fns["ema_update_ (fp32, one _foreach_lerp_)"] = (lambda: ema_update_(anc, pol, TAU), 3 * size * n)
    times = {k: [] for k in fns}
    for _ in range(reps):  # interleaved rounds
        for k, (fn, _) in fns.items():
            times[k].append(C.timed_peak(fn, 1)[0] / 1e3)
    med = {k: statistics.median(ts) for k, ts in times.items()}
    base = next(iter(med.values()))
    return [
        {"op": k, "params": n, "ms": 1e3 * med[k], "GBps": nbytes / med[k] / 1e9, "x_copy": med[k] / base}
        for k, (_, nbytes) in fns.items()
    ]


def ema_rows(reps: int = 20) -> list[dict]:
    rows = _ema_group(False, reps)
    torch.cuda.empty_cache()
    return rows + _ema_group(True, reps)


def _to_cuda(x: dict) -> dict:
    out = {}
    for k, v in x.items():
        if isinstance(v, TokenStats):
            out[k] = TokenStats(*(None if f is None else f.cuda() for f in vars(v).values()))
        else:
            out[k] = v.detach().cuda().requires_grad_(v.requires_grad)
    return out


def _topk_row(variant: str, N: int, reps: int) -> dict:
    """Median ms and peak device memory above the inputs of one variant's value + backward."""
    x = _to_cuda(make_inputs(variant, N, 32))

    def fn():
        value_and_backward(variant, x)
        x["h"].grad, x["W"].grad = None, None

    ms, peak = C.timed_peak(fn, reps)
    return {"variant": variant, "N": N, "ms": ms, "peak_GiB": peak}


def topk_rows(reps: int = 5) -> list[dict]:
    rows = []
    for N in NS:
        for variant in TOPK_VARIANTS:
            rows.append(_topk_row(variant, N, reps))
            torch.cuda.empty_cache()
    return rows


def render(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"Measured on {m['gpu']}, torch {m['torch']}, driver {m['driver']} ({data['date']}): "
        "`python benchmarks/cuda_kernels.py --json F` there, then `--from-json F` here. Ratios are to the first row "
        "of each group, measured in the same process.",
        "",
        "| EMA update, Qwen2.5-0.5B shapes | ms | GB/s | × copy |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {r['op']} | {r['ms']:.2f} | {r['GBps']:.0f} | {r['x_copy']:.2f} |" for r in data["ema"]]
    lines += [
        "",
        "| Top-k KL value + backward (V=151,936, H=1536, k=32, fp32) | N | ms | peak GiB | × naive time |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    naive = {r["N"]: r["ms"] for r in data["topk"] if r["variant"] == "naive_topk"}
    lines += [
        f"| {r['variant']} | {r['N']} | {r['ms']:.1f} | {r['peak_GiB']:.2f} | {r['ms'] / naive[r['N']]:.2f} |"
        for r in data["topk"]
    ]
    lines += [""] + [f"- {n}" for n in data.get("notes", [])]  # added to the JSON by hand
    return "\n".join(lines).rstrip() + "\n"


def measure(data: dict, save) -> None:
    data.update(ema=ema_rows(), topk=topk_rows())


def main() -> int:
    return C.gpu_main(SECTION, __doc__.splitlines()[0], render, measure)


if __name__ == "__main__":
    sys.exit(main())
