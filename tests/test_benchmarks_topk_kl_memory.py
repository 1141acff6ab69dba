"""benchmarks/topk_kl_memory.py's extrapolation (no measurement: the runs are given)."""

from benchmarks import topk_kl_memory as tkm


def run(variant: str, N: int, k: int, peak: float) -> dict:
    return {"variant": variant, "N": N, "k": k, "measured": True, "peak_above_inputs": peak}


def test_a_top_k_extrapolation_uses_the_points_of_its_own_k():
    done = [
        run("exact_reverse", 1024, 0, 4.0),
        run("exact_reverse", 2048, 0, 8.0),
        run("naive_topk", 1024, 32, 2.0),
        run("naive_topk", 2048, 32, 3.0),  # k = 32: 2 + (N - 1024) / 1024
        run("naive_topk", 4096, 256, 100.0),  # another k, at a larger N: not a point of k = 32's line
    ]
    assert tkm._cell(done, "naive_topk", 8192, 32, "peak_above_inputs") == (9.0, True)
    # one point at k = 256: exact reverse KL's intercept (0), scaled through it
    assert tkm._cell(done, "naive_topk", 8192, 256, "peak_above_inputs") == (200.0, True)
