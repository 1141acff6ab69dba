"""Peak memory and time of KL value + backward at the paper's vocabulary (issues 2 and 7).

    python benchmarks/topk_kl_memory.py            # N in {1024, 4096, 8192}, k in {32, 256}
    python benchmarks/topk_kl_memory.py --quick    # N in {1024, 4096} (8192 takes too long on 2 cores)
    python benchmarks/topk_kl_memory.py --print    # print the section instead of writing docs/benchmarks.md

Problem: V = 151,936, H = 1536 (Qwen2.5-1.5B's LM head), N response tokens, fp32 throughout. The
policy's final hidden states h (N, H) and LM-head weight W (V, H) require grad; every variant
computes the token-mean KL against the anchor and backpropagates to h and W:

    exact_reverse / exact_forward  logits = h W^T (N, V); registry estimator on full logits; the
                                   anchor's full (N, V) logits are an input (verl's full mode)
    naive_topk                     logits and log_softmax (N, V) materialised, gathered, topk_reverse
    chunked_topk                   logits (N, V) materialised, token_stats_from_logits (1024 rows/block)
    fused_topk                     token_stats_from_hidden, blocks of 1024 rows x 8192 columns
    fused_topk_wholeV              the same with whole-vocabulary blocks (vocab_chunk_size=None)

Top-k variants: reverse Top-k, unbiased tail, stored (synthetic, random) head indices and anchor
statistics as inputs: only memory and time are measured here; the numbers are tested in
tests/core/test_topk.py and test_fused.py.

Memory: every variant runs in a fresh interpreter; peak RSS above the RSS after the inputs are
allocated (benchmarks/_common.py: VmHWM after resetting it with /proc/self/clear_refs). It counts
everything the computation allocates, including the gradients of h and W it returns (the (V, H)
fp32 weight gradient alone is 0.93 GB). Theoretical minimum above inputs = the gradients of h and
W + the K + 2 per-token statistics (logits_k, lse, logp). Time: wall-clock and process CPU time of
value + backward, one run (no repetition: each is 10-100 s of matmuls). Variants predicted not to
fit in the available RAM (linear extrapolation in N from the largest N measured, + 3 GiB margin)
are skipped and extrapolated instead, marked as such.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402
from ema_pg_core.kl import KLInputs, kl_per_token  # noqa: E402
from ema_pg_core.topk import TokenStats, kl_inputs, token_stats_from_hidden, token_stats_from_logits  # noqa: E402

THREADS = 2
V, H = 151_936, 1536
ROW_CHUNK, VOCAB_CHUNK = 1024, 8192
MARGIN = 3 * C.GiB


# ------------------------------------------------------------------ the variants (run in the worker)
def make_inputs(variant: str, N: int, k: int, Vv: int = V, Hh: int = H) -> dict:
    """Inputs of one variant, allocated before the baseline RSS is read."""
    g = torch.Generator().manual_seed(0)
    x = {
        "h": torch.randn(1, N, Hh, generator=g).requires_grad_(True),
        "W": (0.02 * torch.randn(Vv, Hh, generator=g)).requires_grad_(True),
        "tok": torch.randint(Vv, (1, N), generator=g),
    }
    if variant.startswith("exact"):
        x["ref_logits"] = torch.randn(1, N, Vv, generator=g)
    else:
        x["idx"] = torch.randint(Vv, (1, N, k), generator=g)
        x["anchor"] = TokenStats(
            logp=-5 * torch.rand(1, N, generator=g),
            lse=torch.randn(1, N, generator=g) + 12,
            logits_k=torch.randn(1, N, k, generator=g),
            indices=x["idx"],
        )
    return x


def policy_stats(variant: str, x: dict) -> TokenStats:
    """The policy's Top-k statistics, three ways."""
    h, W, tok, idx = x["h"], x["W"], x["tok"], x["idx"]
    if variant.startswith("fused"):
        vchunk = None if variant.endswith("wholeV") else VOCAB_CHUNK
        return token_stats_from_hidden(h, W, None, tok, indices=idx, chunk_size=ROW_CHUNK, vocab_chunk_size=vchunk)
    logits = h @ W.T  # (1, N, V)
    if variant == "chunked_topk":
        return token_stats_from_logits(logits, tok, indices=idx, chunk_size=ROW_CHUNK)
    logsm = torch.log_softmax(logits, -1)  # naive: a second (1, N, V) tensor
    logp = logsm.gather(-1, tok[..., None])[..., 0]
    lse = logits.gather(-1, tok[..., None])[..., 0] - logp  # LSE = z[label] - log_softmax[label] (verl)
    return TokenStats(logp=logp, lse=lse, logits_k=logits.gather(-1, idx), indices=idx)


def value_and_backward(variant: str, x: dict) -> float:
    if variant.startswith("exact"):
        kl = kl_per_token(variant, KLInputs(logits=x["h"] @ x["W"].T, ref_logits=x["ref_logits"]))
    else:
        kl = kl_per_token("topk_reverse", kl_inputs(policy_stats(variant, x), x["anchor"], x["tok"]), tail="unbiased")
    loss = kl.mean()
    loss.backward()
    assert x["h"].grad is not None and x["W"].grad is not None
    return loss.item()


def worker(variant: str, N: int, k: int) -> dict:
    torch.set_num_threads(THREADS)
    value_and_backward(variant, make_inputs(variant, 64, min(k, 64), Vv=4096, Hh=64))  # load kernels
    x = make_inputs(variant, N, k)
    inputs = sum(t.numel() * t.element_size() for t in _tensors(x))
    gc.collect()
    exact_peak = C.reset_peak_rss()
    rss0 = C.rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    value_and_backward(variant, x)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "variant": variant,
        "N": N,
        "k": k,
        "peak_above_inputs": C.peak_rss_bytes() - rss0,
        "inputs": inputs,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_reset": exact_peak,
    }


def _tensors(x: dict):
    for v in x.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, TokenStats):
            yield from (v.logp, v.lse, v.logits_k)


# ------------------------------------------------------------------ planning and the report (parent)
def minimum_above_inputs(N: int, k: int) -> int:
    """Gradients of h (N, H) and W (V, H) + per-token logits_k, lse, logp (fp32)."""
    return 4 * (N * H + V * H) + 4 * N * (k + 2)


def plan(ns: list[int]) -> list[tuple[str, int, int]]:
    """(variant, N, k) in run order: small N first, so that larger runs can be predicted."""
    runs = []
    for N in ns:
        runs += [("exact_reverse", N, 0), ("exact_forward", N, 0)]
        for k in (32, 256):
            runs += [("naive_topk", N, k), ("chunked_topk", N, k), ("fused_topk", N, k)]
        if N == ns[0]:
            runs.append(("fused_topk_wholeV", N, 32))
    return runs


def predict(done: list[dict], variant: str, N: int, k: int) -> int | None:
    """Linear-in-N prediction of peak + inputs from the largest measured N of this variant."""
    prev = [
        r
        for r in done
        if r["variant"] == variant and r.get("measured") and (r["k"] == k or variant.startswith("exact"))
    ]
    if not prev:
        return None
    r = max(prev, key=lambda r: r["N"])
    return int((r["peak_above_inputs"] + r["inputs"]) * N / r["N"])


def run_all(ns: list[int]) -> list[dict]:
    done: list[dict] = []
    for variant, N, k in plan(ns):
        need = predict(done, variant, N, k)
        avail = C.mem_available_bytes()
        if need is not None and need > avail - MARGIN:
            done.append(
                {"variant": variant, "N": N, "k": k, "measured": False, "predicted_total": need, "available": avail}
            )
            print(
                f"skip {variant} N={N} k={k}: predicted {need / C.GiB:.1f} GiB > available "
                f"{avail / C.GiB:.1f} GiB - margin",
                flush=True,
            )
            if variant == "exact_reverse" and N // 2 not in {r["N"] for r in done if r["variant"] == variant}:
                _run_one(done, variant, N // 2, k)  # a second point for the linear extrapolation
            continue
        _run_one(done, variant, N, k)
    return done


def _run_one(done, variant, N, k):
    t = time.perf_counter()
    r = C.run_worker(Path(__file__), [variant, str(N), str(k)])
    r["measured"] = True
    done.append(r)
    print(
        f"{variant} N={N} k={k}: peak {r['peak_above_inputs'] / C.GiB:.2f} GiB above inputs "
        f"({r['inputs'] / C.GiB:.2f} GiB), {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s cpu "
        f"[{time.perf_counter() - t:.0f} s incl. setup]",
        flush=True,
    )


def extrapolate(done: list[dict], variant: str, N: int, key: str) -> float | None:
    """Linear fit a + b N of ``key`` through the measured points; with one point of this variant,
    the intercept of exact_reverse's fit is borrowed (same weight-gradient and fixed costs)."""
    pts = sorted((r["N"], r[key]) for r in done if r["variant"] == variant and r.get("measured"))
    if len(pts) >= 2:
        (n0, y0), (n1, y1) = pts[-2], pts[-1]
        b = (y1 - y0) / (n1 - n0)
        return y1 + b * (N - n1)
    ref = sorted((r["N"], r[key]) for r in done if r["variant"] == "exact_reverse" and r.get("measured"))
    if not pts or len(ref) < 2:
        return None
    (n0, y0), (n1, y1) = ref[-2], ref[-1]
    a = y0 - (y1 - y0) / (n1 - n0) * n0
    n, y = pts[-1]
    return a + (y - a) * N / n


def _cell(done, variant, N, k, key):
    """(value, extrapolated?) of a measured or extrapolated key."""
    for r in done:
        if (
            r["variant"] == variant
            and r["N"] == N
            and (r["k"] == k or variant.startswith("exact"))
            and r.get("measured")
        ):
            return r[key], False
    return extrapolate(done, variant, N, key), True


LABELS = {
    "exact_reverse": "exact reverse KL",
    "exact_forward": "exact forward KL",
    "naive_topk": "naive Top-k",
    "chunked_topk": "chunked Top-k from logits",
    "fused_topk": "fused Top-k from hidden",
    "fused_topk_wholeV": "fused Top-k, whole-V blocks",
}
"""Variant -> its name in the section's tables."""
TABLE_HEADER = [
    "variant",
    "k",
    "peak above inputs (GiB)",
    "ratio vs exact",
    "inputs (GiB)",
    "time wall / cpu (s)",
    "cpu-time ratio vs naive Top-k",
]


def section(done: list[dict], ns: list[int], m: dict, argv: list[str], wall_total: float) -> str:
    out = _intro(ns, m, argv, wall_total)
    for N in ns:
        out += [f"### N = {N:,}", "", C.md_table(TABLE_HEADER, _table_rows(done, N)), ""]
    out += _extra_lines(done, ns)
    out += _target(done, ns)
    return "\n".join(out) + "\n"


def _intro(ns: list[int], m: dict, argv: list[str], wall_total: float) -> list[str]:
    """Title, command, machine, the problem and accounting paragraph, and a note if N = 8192 was not run."""
    cmd = "python benchmarks/topk_kl_memory.py" + (" " + " ".join(argv) if argv else "")
    out = [
        "## Top-k KL memory and time at V = 151,936 (`benchmarks/topk_kl_memory.py`)",
        "",
        f"Command: `{cmd}` (total {wall_total / 60:.1f} min)  ",
        C.machine_line(m, THREADS),
        "",
        f"Problem: value + backward of the token-mean KL w.r.t. h (N, {H}) and W ({V:,}, {H}), fp32. Memory = peak "
        "RSS above the inputs, in a fresh process per variant (VmHWM reset via /proc/self/clear_refs); it includes "
        f"the returned gradients (the W gradient alone is {4 * V * H / C.GiB:.2f} GiB). "
        f"Fused blocks: {ROW_CHUNK} rows x "
        f"{VOCAB_CHUNK} columns; chunked-from-logits: {ROW_CHUNK} rows. "
        f"Memory ratio: / exact reverse KL at the same N; "
        "time ratio: / naive Top-k at the same N and k, on process CPU time (less sensitive than wall time to the "
        "other jobs on the 2 cores; wall time is listed too). `~` marks values extrapolated linearly in N "
        "(variant not run: predicted not to fit in RAM). At N = 1,024 the chunked-from-logits path has a single "
        "row block (1024 rows = N), so it matches the naive one there.",
        "",
    ]
    if 8192 not in ns:
        out += [
            "N = 8192 was not run (`--quick`): on this 2-core machine the full grid takes well over 15 minutes.",
            "",
        ]
    return out


def _table_rows(done: list[dict], N: int) -> list[list]:
    """The rows of the table at N: exact KL, then per k every Top-k variant run and the theoretical minimum."""
    ex, ex_x = _cell(done, "exact_reverse", N, 0, "peak_above_inputs")
    rows = []
    for variant, k in [("exact_reverse", None), ("exact_forward", None)] + [
        (v, k) for k in (32, 256) for v in ("naive_topk", "chunked_topk", "fused_topk", "fused_topk_wholeV", "minimum")
    ]:
        if variant == "minimum":
            mem = minimum_above_inputs(N, k)
            rows.append([f"theoretical minimum (k={k})", k, f"{mem / C.GiB:.3f}", _ratio(mem, ex, ex_x), "", "", ""])
        elif any(r["variant"] == variant and r["N"] == N and (k is None or r["k"] == k) for r in done):
            rows.append(_variant_row(done, variant, N, k, ex=ex, ex_x=ex_x))
    return rows


def _variant_row(done: list[dict], variant: str, N: int, k: int | None, *, ex, ex_x: bool) -> list:
    """One variant's row: measured or extrapolated (marked `~`) memory, inputs, time and the two ratios."""
    mem, x_ = _cell(done, variant, N, k or 0, "peak_above_inputs")
    inp, _ = _cell(done, variant, N, k or 0, "inputs")
    wall, _ = _cell(done, variant, N, k or 0, "wall_s")
    cpu, _ = _cell(done, variant, N, k or 0, "cpu_s")
    base = None if k is None else _cell(done, "naive_topk", N, k, "cpu_s")
    t = "" if base is None or base[0] is None or cpu is None else f"{'~' if x_ or base[1] else ''}{cpu / base[0]:.2f}"
    mark = "~" if x_ else ""
    return [
        LABELS[variant],
        "—" if k is None else k,
        f"{mark}{_g(mem)}",
        _ratio(mem, ex, ex_x or x_),
        f"{mark}{_g(inp)}",
        f"{mark}{wall:.1f} / {cpu:.1f}" if wall else "",
        t,
    ]


def _extra_lines(done: list[dict], ns: list[int]) -> list[str]:
    """The runs measured only as a second point for the extrapolation (at an N outside the grid)."""
    extra = [r for r in done if r.get("measured") and r["N"] not in ns]
    if not extra:
        return []
    return [
        "Measured only for the extrapolation: "
        + "; ".join(
            f"{LABELS[r['variant']]} at N = {r['N']:,}: {_g(r['peak_above_inputs'])} GiB above inputs, "
            f"{r['cpu_s']:.1f} s cpu"
            for r in extra
        )
        + ".",
        "",
    ]


def _g(b):
    return "" if b is None else f"{b / C.GiB:.3f}"


def _ratio(mem, ex, approx):
    return (
        "" if mem is None or not ex else f"{'~' if approx else ''}1/{ex / mem:.1f}" if mem < ex else f"{mem / ex:.2f}"
    )


def _target(done, ns) -> list[str]:
    N = 4096 if 4096 in ns else ns[-1]
    fused, _ = _cell(done, "fused_topk", N, 32, "peak_above_inputs")
    ex, ex_x = _cell(done, "exact_reverse", N, 0, "peak_above_inputs")
    if fused is None or ex is None:
        return []
    grads, minimum = 4 * (N * H + V * H), minimum_above_inputs(N, 32)
    verdict = "met" if fused * 20 <= ex else f"missed by a factor {fused * 20 / ex:.2f}"
    return [
        f"Target (issue 7), fused peak ≤ 1/20 of exact at N = {N:,}, k = 32: 1/{ex / fused:.1f}"
        f"{' (exact extrapolated)' if ex_x else ''}, **{verdict}**. Of the fused peak ({fused / C.GiB:.2f} GiB), "
        f"{grads / C.GiB:.2f} GiB are the returned gradients of h and W, which the theoretical minimum holds too "
        f"(itself 1/{ex / minimum:.1f} of exact here); without them the fused path's working memory is "
        f"{(fused - grads) / C.GiB:.3f} GiB vs {(ex - grads) / C.GiB:.2f} GiB for exact KL.",
        "",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N in {1024, 4096} only")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the section, do not write the doc")
    p.add_argument("--ns", type=int, nargs="+", help=argparse.SUPPRESS)  # e.g. --ns 256 for a smoke run
    p.add_argument("--json", default="/tmp/topk_kl_memory.json", help="where the raw measurements are saved")
    p.add_argument("--from-json", action="store_true", help="re-render the section from --json without measuring")
    p.add_argument("--worker", nargs=3, metavar=("VARIANT", "N", "K"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))))
        return 0
    if a.from_json:
        raw = json.loads(Path(a.json).read_text())
    else:
        ns = a.ns or ([1024, 4096] if a.quick else [1024, 4096, 8192])
        cmd = [x for x in (argv if argv is not None else sys.argv[1:]) if x not in ("--print",)]
        m, t = C.machine(), time.perf_counter()
        done = run_all(ns)
        raw = {"runs": done, "ns": ns, "machine": m, "argv": cmd, "wall": time.perf_counter() - t}
        Path(a.json).write_text(json.dumps(raw))
    text = section(raw["runs"], raw["ns"], raw["machine"], raw["argv"], raw["wall"])
    print(text)
    if not a.print_only:
        C.write_section("topk_kl_memory", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
