"""Per-problem evaluation rows of verl's validation, and the EMA anchor's turn at it. No verl imports.

verl's validation keeps only per-source means; ``EmaPGTrainerSync`` also writes one row per prompt and model to
``verl_evals.jsonl`` beside verl's metrics file, in the run record's evals.jsonl schema (docs/run-record.md).
A response is correct when its score is > 0; ``problem_id`` is ``<data_source>/<16 hex of the prompt's sha1>``.
After the first update each validation also runs with the anchor's weights in the actor (``load_anchor_``,
``restore_actor_``), its metrics renamed ``val-anchor-`` (``anchor_keys``); before it the policy's are copied.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

FILE = "verl_evals.jsonl"


def evals_path(metrics_path: str | None) -> str | None:
    """verl_evals.jsonl beside verl's metrics file (None without one)."""
    return os.path.join(os.path.dirname(os.path.abspath(metrics_path)), FILE) if metrics_path else None


def problem_id(source: str, prompt: str) -> str:
    return f"{source}/{hashlib.sha1(prompt.encode('utf-8')).hexdigest()[:16]}"


def problem_rows(
    iteration: int, model: str, *, sources: Sequence, uids: Sequence, prompts: Sequence, scores: Sequence, greedy: bool
) -> list[dict[str, Any]]:
    """One row per validation prompt (its samples share a uid; the four lists are per sample, aligned)."""
    if not len(sources) == len(uids) == len(prompts) == len(scores):
        raise ValueError(f"misaligned validation samples: {len(sources)}, {len(uids)}, {len(prompts)}, {len(scores)}")
    groups: dict[str, dict[str, Any]] = {}
    for source, uid, prompt, score in zip(sources, uids, prompts, scores):
        g = groups.setdefault(str(uid), {"source": str(source), "prompt": prompt, "ok": []})
        g["ok"].append(int(float(score) > 0))
    return [
        {
            "iteration": int(iteration),
            "model": model,
            "benchmark": g["source"],
            "problem_id": problem_id(g["source"], g["prompt"]),
            "n": len(g["ok"]),
            "n_correct": sum(g["ok"]),
            "greedy_correct": g["ok"][0] if greedy else None,
        }
        for g in groups.values()
    ]


def anchor_keys(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """verl's validation metrics of the anchor: ``val-core/...`` -> ``val-anchor-core/...`` (``val-aux`` too)."""
    return {("val-anchor-" + k[len("val-") :] if k.startswith("val-") else k): v for k, v in metrics.items()}


def append_rows(path: str | None, rows: list[dict[str, Any]]) -> None:
    if not path or not rows:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


@torch.no_grad()
def load_anchor_(actor: list[torch.Tensor], anchor: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy the anchor's local shards into the actor's; return the actor's, kept aside on the host."""
    saved = [a.detach().to("cpu", copy=True) for a in actor]
    for a, r in zip(actor, anchor):
        a.copy_(r)
    return saved


@torch.no_grad()
def restore_actor_(actor: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    for a, s in zip(actor, saved):
        a.copy_(s)
