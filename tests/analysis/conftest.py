"""Synthetic run records in the documented format (docs/run-record.md) and audit records
(analysis/audit_schema.py) for the analysis tests. Everything is generated; no training."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from experiments import records


def config(
    task: str,
    seed: int,
    tau: float,
    kl_type: str = "topk",
    k: int | None = 4,
    tail: str | None = "unbiased",
    period: int = 2,
    sweep: str | None = "quickstart",
    experiment: str | None = None,
) -> dict[str, Any]:
    """A resolved config with the keys analysis reads (and one it does not)."""
    return {
        "experiment": experiment or ("ema_pg_tiny" if tau < 1 else "grpo_tiny"),
        "task": {"name": task, "n_problems": 5},
        "seed": seed,
        "backend": {"name": "local"},
        "algo": {"kl": {"type": kl_type, "k": k, "tail": tail, "coef": 0.01}, "anchor": {"tau": tau, "period": period}},
        "trainer": {"iterations": 6},
        "sweep": {"name": sweep, "trial_id": f"t{seed}"} if sweep else {"name": None, "trial_id": None},
    }


def metric_rows(task: str, seed: int, tau: float, iterations: int = 6) -> list[dict[str, Any]]:
    """Iteration 0 holds only eval keys; evals every 2 iterations. EMA-PG learns faster."""
    lift = {1.0: 0.0, 0.9: 0.05}.get(tau, 0.035)
    rows = []
    for it in range(iterations + 1):
        row: dict[str, Any] = {"iteration": it, "time_s": 0.5 * it}
        if it > 0:
            row.update(
                {
                    "train/reward": 0.1 * it + lift + 0.01 * seed,
                    "kl/value": 0.01 * it,
                    "anchor/drift": (0.02 * it if tau < 1 else 0.03 * it),
                    "anchor/updated": int(tau < 1 and it % 2 == 0),
                    "loss/total": 1.0 / it,
                }
            )
        if it % 2 == 0:
            acc = min(1.0, 0.2 + (0.05 + lift) * it + 0.02 * seed)
            row.update(
                {
                    f"eval/{task}/acc": acc,
                    f"eval/{task}/pass@1": acc - 0.05,
                    f"eval_anchor/{task}/acc": acc - 0.1 * (tau < 1),
                }
            )
        rows.append(row)
    return rows


def eval_rows(task: str, seed: int, tau: float, iterations: int = 6) -> list[dict[str, Any]]:
    """5 problems x n=4 samples, at iteration 0 and the last one, for policy and anchor."""
    rows = []
    for it in (0, iterations):
        for model in ("policy", "anchor"):
            for pid in range(5):
                c = min(4, (pid + seed + (it > 0) * (2 if tau < 1 else 1)) % 5)
                rows.append(
                    {
                        "iteration": it,
                        "model": model,
                        "benchmark": task,
                        "problem_id": f"p{pid}",
                        "n": 4,
                        "n_correct": c,
                        "greedy_correct": int(c >= 2),
                    }
                )
    return rows


def write_run(
    root: Path,
    run_id: str,
    cfg: dict[str, Any],
    rows: list[dict[str, Any]],
    *,
    status: str = "finished",
    error: str | None = None,
    summary: bool = True,
    evals: list[dict[str, Any]] | None = None,
    truncate: bool = False,
) -> Path:
    """Write one run directory; `truncate` cuts the last metrics line in half (a crash)."""
    d = root / run_id
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [json.dumps(r) for r in rows]
    text = "\n".join(lines) + "\n"
    if truncate:
        text = "\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2]
    (d / "metrics.jsonl").write_text(text)
    if evals is not None:
        (d / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (d / "status").write_text(status + ("\n" + error if error else "") + "\n")
    if summary:
        final, best = records.final_values(rows), records.best_values(rows)  # as RunRecord.summary writes them
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "run_id": run_id,
                    "status": status,
                    "experiment": cfg["experiment"],
                    "task": cfg["task"]["name"],
                    "seed": cfg["seed"],
                    "config_hash": f"h{zlib.crc32(run_id.encode()):08x}",
                    "git_sha": "abc1234",
                    "wandb_run_id": f"wb{run_id[-8:]}",
                    "iterations_done": rows[-1]["iteration"],
                    "wall_time_s": rows[-1]["time_s"],
                    "final": final,
                    "best": best,
                }
            )
        )
    (d / "checkpoints").mkdir()
    return d


def rid(task: str, exp: str, seed: int, n: int = 0) -> str:
    return f"{task}__{exp}__s{seed}__20260101-0000{n:02d}"


@pytest.fixture
def synth() -> SimpleNamespace:
    """The record-writing helpers of this file, for tests that build their own runs."""
    return SimpleNamespace(config=config, metric_rows=metric_rows, eval_rows=eval_rows, write_run=write_run, rid=rid)


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    """A quickstart-like sweep: GRPO (τ=1, K3) and EMA-PG (τ ∈ {0.9, 0.95}, Top-k) x 3 seeds on
    math_tiny, plus one failed run and one partial run whose last metrics line is truncated."""
    root = tmp_path / "sweep"
    (root / "runs").mkdir(parents=True)
    (root / "sweep.yaml").write_text(
        yaml.safe_dump({"name": "quickstart", "metric": "eval/math_tiny/acc", "mode": "max"})
    )
    (root / "sweep.csv").write_text("trial_id,run_id\n")
    n = 0
    for seed in range(3):
        for tau, kl, k, tail in ((1.0, "k3", None, None), (0.9, "topk", 4, "unbiased"), (0.95, "topk", 4, "unbiased")):
            exp = "grpo_tiny" if tau == 1 else f"ema_pg_tiny_tau{tau}"
            n += 1
            write_run(
                root / "runs",
                rid("math_tiny", exp, seed, n),
                config("math_tiny", seed, tau, kl, k, tail, experiment=exp),
                metric_rows("math_tiny", seed, tau),
                evals=eval_rows("math_tiny", seed, tau),
            )
    write_run(
        root / "runs",
        rid("math_tiny", "ema_pg_tiny_tau0.9", 7, 90),
        config("math_tiny", 7, 0.9),
        metric_rows("math_tiny", 7, 0.9)[:4],
        status="failed",
        summary=False,
        error='Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: NaN loss',
    )
    write_run(
        root / "runs",
        rid("math_tiny", "ema_pg_tiny_tau0.9", 8, 91),
        config("math_tiny", 8, 0.9),
        metric_rows("math_tiny", 8, 0.9)[:5],
        status="running",
        summary=False,
        truncate=True,
    )
    return root


@pytest.fixture
def audit_records() -> dict[str, Any]:
    """Synthetic records in the schema of analysis/audit_schema.py (numbers are made up)."""
    est = []
    for name, direction, k, tail, vb, gb in (
        ("exact", "reverse", None, None, 0.0, 0.0),
        ("k1", "reverse", None, None, 1e-3, 0.5),
        ("k2", "reverse", None, None, 0.2, 1e-3),
        ("k3", "reverse", None, None, 2e-3, 0.3),
        ("k3pp", "reverse", None, None, 1e-3, 1e-3),
        ("k4", "reverse", None, None, 1e-3, 1e-3),
        ("k5", "forward", None, None, 1e-3, 1e-3),
        ("topk", "reverse", 4, "paper", 1e-17, 0.12),
        ("topk", "reverse", 4, "unbiased", 1e-17, 2e-10),
        ("topk", "forward", 4, "unbiased", 0.0, 1e-10),
    ):
        est.append(
            {
                "estimator": name,
                "direction": direction,
                "tail": tail,
                "k": k,
                "value_bias": vb,
                "grad_bias": gb,
                "value_unbiased": vb < 1e-2,
                "grad_unbiased": gb < 1e-2,
                "variance": 0.0 if name == "exact" else 0.05,
                "grad_variance": 0.0 if name == "exact" else 0.1,
                "bytes_per_token": 607744 if name == "exact" else (68 if k else 8),
            }
        )
    topk = [
        {
            "direction": d,
            "tail": t,
            "k": k,
            "value_variance": 0.05 * (1 - k / 12) ** 2,
            "grad_variance": 0.1 * (1 - k / 12),
            "value_bias": 0.0,
            "grad_bias": 0.0,
        }
        for d in ("reverse", "forward")
        for t in ("paper", "unbiased")
        for k in range(13)
    ]
    horizon = [
        {"tau": t, "period": p, "half_life": p * math.log(0.5) / math.log(t), "time_constant": p / (1 - t)}
        for p in (1, 10)
        for t in (0.5, 0.8, 0.9, 0.95, 0.99)
    ]
    stab = [
        {"alpha": a / 10, "beta_c": b / 2, "eta": eta, "stable": (a / 10) * (1.0 + 2 * eta / (1 + eta) * b / 2) < 2}
        for eta in (0.0, 0.5, 0.9)
        for a in range(1, 30)
        for b in range(0, 12)
    ]
    return {
        "estimator_table": est,
        "topk_sweep": topk,
        "anchor_horizon": horizon,
        "stability_grid": stab,
        "meta": {"vocab_size": 12, "seed": 0, "n_distributions": 50},
    }
