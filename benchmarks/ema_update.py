"""EMA anchor update throughput (issue 7, part 3) against a same-size copy and a per-parameter loop.

    python benchmarks/ema_update.py            # 0.5B parameters (Qwen2.5-0.5B shapes), 20 rounds
    python benchmarks/ema_update.py --quick    # same sizes, 5 rounds
    python benchmarks/ema_update.py --print    # print the section instead of writing docs/benchmarks.md

Tensors: the 290 parameter shapes of Qwen2.5-0.5B (494M parameters, tied embeddings), filled
with uniform noise. Each dtype configuration runs in its own fresh interpreter:

    fp32          policy fp32, anchor fp32 (EmaAnchor without shadow): 2 x 1.98 GB
    bf16+shadow   policy bf16, anchor module bf16 + fp32 shadow (EmaAnchor(fp32_shadow=True))

Byte accounting (bytes of the stored operands each op must read and write, temporaries excluded):
    copy        dst <- src                       read 1, write 1 tensor      (8 B/param fp32, 4 bf16)
    lerp        a <- a + w (p - a)               read 2, write 1             (12 B/param fp32, 6 bf16)
    shadow      s <- lerp(s, p_bf16); m <- s     read 2+4+4, write 4+2       (16 B/param)
Throughput = accounted bytes / fastest wall time of interleaved rounds (1 GB = 1e9 B); every
ratio is against the copy of the same tensors in the same process (fp32 copy for fp32, bf16 copy
for bf16+shadow).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402
from ema_pg_core.anchor import EmaAnchor, ema_update_  # noqa: E402
from ema_pg_core.config import AnchorConfig  # noqa: E402

THREADS = 2
TAU = 0.9


def qwen25_05b_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of Qwen2.5-0.5B: 24 layers, hidden 896, MLP 4864, 14 q / 2 kv heads of 64."""
    V, D, F, KV = 151_936, 896, 4864, 128
    layer = [
        (D, D),
        (D,),
        (KV, D),
        (KV,),
        (KV, D),
        (KV,),
        (D, D),  # q, k, v (+ biases), o
        (F, D),
        (F, D),
        (D, F),
        (D,),
        (D,),
    ]  # gate, up, down, two RMSNorms
    return [(V, D)] + layer * 24 + [(D,)]


class Params(nn.Module):
    def __init__(self, shapes, dtype):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.empty(s, dtype=dtype).uniform_(-0.05, 0.05)) for s in shapes)


def timed_round_robin(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds of ``reps`` calls of every fn, interleaved in a shuffled order each round (so that load
    from other jobs hits all variants alike), after one warm-up call each."""
    for fn in fns.values():
        fn()
    ts = {name: [] for name in fns}
    rng = random.Random(0)
    for _ in range(reps):
        for name in rng.sample(list(fns), len(fns)):
            fn = fns[name]
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    return ts


def worker(config: str, reps: int) -> dict:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    dtype = torch.float32 if config == "fp32" else torch.bfloat16
    policy = Params(qwen25_05b_shapes(), dtype)
    anchor = EmaAnchor(policy, AnchorConfig(TAU, period=1, fp32_shadow=(config != "fp32")))
    pol = [p.detach() for p in policy.parameters()]
    anc = [p.detach() for p in anchor.module.parameters()]
    n = sum(p.numel() for p in pol)
    size = pol[0].element_size()

    def loop():
        for a, p in zip(anc, pol):
            a.lerp_(p, 1.0 - TAU)

    variants = {  # name: (callable, accounted bytes)
        f"copy ({str(dtype)[6:]}, torch._foreach_copy_)": (lambda: torch._foreach_copy_(anc, pol), 2 * size * n),
        f"lerp ({str(dtype)[6:]}, ema_update_, one foreach op)": (lambda: ema_update_(anc, pol, TAU), 3 * size * n),
        f"lerp ({str(dtype)[6:]}, Python loop over parameters)": (loop, 3 * size * n),
    }
    if config == "fp32":
        variants["EmaAnchor.update (fp32)"] = (lambda: anchor.update(1, policy), 12 * n)
    else:
        variants["EmaAnchor.update (bf16 module + fp32 shadow, sliced cast)"] = (
            lambda: anchor.update(1, policy),
            16 * n,
        )

        def whole_cast():  # the previous implementation: cast the whole policy, lerp, copy out
            torch._foreach_lerp_(anchor.shadow, [p.float() for p in pol], 1.0 - TAU)
            torch._foreach_copy_(anc, anchor.shadow)

        variants["shadow update, whole-policy cast (previous code)"] = (whole_cast, 16 * n)
    ts = timed_round_robin({k: fn for k, (fn, _) in variants.items()}, reps)
    out = {"config": config, "params": n, "tensors": len(pol), "reps": reps, "rows": []}
    for name, (_, nbytes) in variants.items():
        t, med = min(ts[name]), statistics.median(ts[name])
        out["rows"].append({"variant": name, "seconds": t, "median_s": med, "bytes": nbytes, "gbps": nbytes / t / C.GB})
    return out


def section(results: list[dict], m: dict, argv: list[str]) -> str:
    lines = _intro(results, m, argv)
    lines.append(
        C.md_table(
            ["config", "variant", "GB accounted", "ms (best / median)", "GB/s (best)", "ratio vs copy"],
            _table_rows(results),
        )
    )
    lines += _disturbance_warning(results)
    lines += ["", "Target (issue 7): the anchor update at ≥ 80% of the same-size copy's bandwidth."]
    lines += _target_lines(results)
    return "\n".join(lines) + "\n"


def _intro(results: list[dict], m: dict, argv: list[str]) -> list[str]:
    """Title, command, machine and the accounting paragraph."""
    cmd = "python benchmarks/ema_update.py" + (" " + " ".join(argv) if argv else "")
    return [
        "## EMA anchor update bandwidth (`benchmarks/ema_update.py`)",
        "",
        f"Command: `{cmd}`  ",
        C.machine_line(m, THREADS),
        "",
        f"Tensors: Qwen2.5-0.5B parameter shapes, {results[0]['params'] / 1e6:.0f}M parameters in "
        f"{results[0]['tensors']} tensors. Accounting: copy reads 1 + writes 1 stored tensor, lerp reads 2 + "
        "writes 1, the shadow update reads policy (bf16) + shadow and writes shadow, then reads shadow and "
        "writes the bf16 module (16 B/param); temporaries are not counted. Variants are timed round-robin "
        f"({results[0]['reps']} rounds in shuffled order after a warm-up) and "
        f"the throughput uses the fastest round (the "
        "least disturbed by the other jobs on the machine); the median is listed too. Ratio = throughput / "
        "throughput of the copy in the same process.",
        "",
    ]


def _table_rows(results: list[dict]) -> list[list[str]]:
    """One row per variant and config; the ratio is against the config's copy (its first row)."""
    rows = []
    for res in results:
        base = res["rows"][0]["gbps"]
        for r in res["rows"]:
            rows.append(
                [
                    res["config"],
                    r["variant"],
                    f"{r['bytes'] / C.GB:.2f}",
                    f"{r['seconds'] * 1e3:.0f} / {r['median_s'] * 1e3:.0f}",
                    f"{r['gbps']:.1f}",
                    f"{r['gbps'] / base:.2f}",
                ]
            )
    return rows


def _disturbance_warning(results: list[dict]) -> list[str]:
    """A warning when some median is over 1.5x its best time (other jobs disturbed the run)."""
    worst = max(r["median_s"] / r["seconds"] for res in results for r in res["rows"])
    if worst <= 1.5:
        return []
    return [
        "",
        f"**Warning:** a median is {worst:.1f}x its best time: other jobs disturbed this run; "
        "rerun on a quiet machine before trusting the ratios.",
    ]


def _target_lines(results: list[dict]) -> list[str]:
    """Met / missed per EmaAnchor.update row against 80% of the same config's copy bandwidth."""
    lines = []
    for res in results:
        base = res["rows"][0]["gbps"]
        for r in res["rows"]:
            if r["variant"].startswith("EmaAnchor.update"):
                ok = r["gbps"] >= 0.8 * base
                lines.append(
                    f"- {r['variant']}: {r['gbps'] / base:.2f} of the copy's bandwidth: "
                    + ("**met**." if ok else f"**missed** by {0.8 - r['gbps'] / base:.2f}.")
                )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="5 rounds instead of 20")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the section, do not write the doc")
    p.add_argument("--json", default="/tmp/ema_update.json", help="where the raw measurements are saved")
    p.add_argument("--from-json", action="store_true", help="re-render the section from --json without measuring")
    p.add_argument("--worker", nargs=2, metavar=("CONFIG", "REPS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker[0], int(a.worker[1]))))
        return 0
    if a.from_json:
        raw = json.loads(Path(a.json).read_text())
    else:
        cmd = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--print"]
        m, reps = C.machine(), 5 if a.quick else 20
        results = [C.run_worker(Path(__file__), [cfg, str(reps)]) for cfg in ("fp32", "bf16_shadow")]
        raw = {"results": results, "machine": m, "argv": cmd}
        Path(a.json).write_text(json.dumps(raw))
    text = section(raw["results"], raw["machine"], raw["argv"])
    print(text)
    if not a.print_only:
        C.write_section("ema_update", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
