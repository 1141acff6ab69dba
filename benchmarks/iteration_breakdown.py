"""Where an iteration of the local trainer spends its time, against the model's own raw operations.

    python benchmarks/iteration_breakdown.py [--iterations 12] [--threads 2] [--mini-batches 1] [--write]

For each preset (default: the math_tiny presets) two trainers run side by side, interleaved
iteration by iteration on the same seed, so they sample the same batches:

- new: ``trainer.old_logprobs=rollout`` (pi_old's statistics kept by the sampler while decoding);
- old: ``trainer.old_logprobs=recompute`` (a separate no-grad pi_old forward pass).

After every iteration the same batch is replayed through the model's raw operations, at the same
shapes, in the same process: a KV-cache decode of the same contexts for the same number of steps
(sampling, no bookkeeping), one forward + backward of the policy on the padded batch (log-softmax
at the sampled tokens), and one no-grad forward of the anchor. Every figure is a ratio to those,
measured in the same run: rollout / raw decode; iteration / (raw decode + raw forward-backward per
optimizer step + anchor forward); old iteration / new iteration. Medians over iterations; the first
iteration is dropped as warm-up. ``--write`` replaces the section in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402

PHASES = ("rollout", "reward", "logprob", "update", "anchor", "iter")


def trainer(preset: str, mode: str, mini_batches: int, ckpt_dir: str):
    """A LocalTrainer for the preset (warm-started tiny model from the cache), W&B and checkpoints off."""
    from ema_pg_core.local.trainer import LocalTrainer, seed_everything
    from experiments import build

    cfg = build.compose(
        [
            f"experiment={preset}",
            f"trainer.old_logprobs={mode}",
            f"trainer.mini_batches={mini_batches}",
            "trainer.probe_every=0",
        ]
    )
    local = build.validate(cfg)
    policy, tok = build.model(cfg)
    seed_everything(int(cfg.seed))
    tr = LocalTrainer(policy, tok, build.task(cfg), local, ckpt_dir)
    tr.seen = []  # the last rollout's trajectories, for the raw replay

    def keep(*a, **kw):
        out = type(tr)._rollout(tr, *a, **kw)
        tr.seen = out
        return out

    tr._rollout = keep
    return tr


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def raw_decode(model, tok, trajs, temperature: float, generator) -> None:
    """Prefill the same left-padded prompts, then decode as many steps as the rollout did (sampling only)."""
    import torch

    with torch.no_grad():
        ctx = [t.prompt_ids for t in trajs]
        L, steps = max(map(len, ctx)), max(len(t.response_ids) for t in trajs)
        ids = torch.tensor([[tok.pad_token_id] * (L - len(c)) + c for c in ctx])  # (B, L)
        attn = torch.tensor([[0] * (L - len(c)) + [1] * (len(c) + steps) for c in ctx])  # (B, L + steps)
        pos = (attn[:, :L].cumsum(-1) - 1).clamp_min(0)
        out = model(input_ids=ids, attention_mask=attn[:, :L], position_ids=pos, use_cache=True)
        for s in range(steps - 1):
            p = torch.softmax(out.logits[:, -1].float() / temperature, -1)
            nxt = torch.multinomial(p, 1, generator=generator)  # (B, 1)
            pos = pos[:, -1:] + 1
            kv = out.past_key_values
            out = model(input_ids=nxt, attention_mask=attn[:, : L + s + 1], position_ids=pos, past_key_values=kv)


def raw_forward_backward(model, batch) -> None:
    """One forward + backward of the policy on the padded batch: log-softmax at the sampled tokens."""
    import torch

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, L, V)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[..., None])  # (B, L, 1)
    (logp[..., 0] * batch.attention_mask).sum().backward()
    model.zero_grad(set_to_none=True)


def anchor_forward(model, batch) -> None:
    import torch

    with torch.no_grad():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)


def replay(tr) -> dict:
    """Raw operations on the batch the trainer just sampled (seconds)."""
    import torch

    from ema_pg_core.local.batch import collate

    batch = collate(tr.seen, tr.tok.pad_token_id, device=tr.device)
    g = torch.Generator().manual_seed(0)
    steps = tr.cfg.trainer.ppo_epochs * tr.cfg.trainer.mini_batches
    return {
        "raw_decode": _timed(lambda: raw_decode(tr.policy, tr.tok, tr.seen, tr.cfg.rollout.temperature, g)),
        "raw_fwd_bwd": steps * _timed(lambda: raw_forward_backward(tr.policy, batch)),
        "anchor_fwd": _timed(lambda: anchor_forward(tr.anchor.module, batch)) if tr.cfg.algo.kl.coef else 0.0,
    }


def measure(preset: str, iterations: int, threads: int, mini_batches: int) -> dict:
    """{mode: {phase or raw op: median seconds}} for the new and old path, interleaved."""
    import torch

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        trs = {m: trainer(preset, m, mini_batches, f"{d}/{m}") for m in ("rollout", "recompute")}
        rows: dict[str, list[dict]] = {m: [] for m in trs}
        for it in range(iterations):
            for mode, tr in trs.items():
                m = tr.step()
                row = {p: m[f"perf/{p}_s"] for p in PHASES}
                row.update(replay(tr))
                if it > 0:  # the first iteration is warm-up
                    rows[mode].append(row)
    return {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in rows.items()}


def ratios(r: dict) -> dict:
    new, old = r["rollout"], r["recompute"]
    base = new["raw_decode"] + new["raw_fwd_bwd"] + new["anchor_fwd"]
    return {
        "rollout_vs_raw_decode": new["rollout"] / new["raw_decode"],
        "iter_vs_raw_sum": new["iter"] / base,
        "old_vs_new_iter": old["iter"] / new["iter"],
        "old_rollout_vs_raw_decode": old["rollout"] / old["raw_decode"],
    }


PHASE_COLUMNS = {
    "rollout": "rollout",
    "reward": "rewards + batch",
    "logprob": "pi_old + anchor passes",
    "update": "update",
    "raw_decode": "raw decode",
    "raw_fwd_bwd": "raw fwd+bwd",
    "anchor_fwd": "anchor fwd",
}
RATIO_COLUMNS = {
    "rollout_vs_raw_decode": "rollout / raw decode",
    "iter_vs_raw_sum": "iteration / (raw decode + raw fwd+bwd + anchor fwd)",
    "old_vs_new_iter": "old iteration / new iteration",
    "old_rollout_vs_raw_decode": "old rollout / raw decode",
}


def report(results: dict, args, machine: dict) -> str:
    rows, rat = [], []
    for preset, r in results.items():
        for mode, label in (("recompute", "old (recompute)"), ("rollout", "new (from the sampler)")):
            x = r[mode]
            rows.append([preset, label, f"{x['iter']:.3f}", *(f"{x[k]:.3f}" for k in PHASE_COLUMNS)])
        q = ratios(r)
        rat.append([preset, *(f"{q[k]:.2f}x" for k in RATIO_COLUMNS)])
    command = (
        f"python benchmarks/iteration_breakdown.py --iterations {args.iterations} --threads {args.threads} "
        f"--mini-batches {args.mini_batches} --write"
    )
    parts = [
        "## Local-trainer iteration vs the model's raw operations (`benchmarks/iteration_breakdown.py`)",
        "",
        f"Command: `{command}` (warm model cache; W&B off; medians over iterations 2..N).",
        C.machine_line(machine, args.threads),
        "",
        "Seconds per iteration and phase (the raw operations replay the same batch at the same shapes):",
        "",
        C.md_table(["preset", "path", "iteration (s)", *PHASE_COLUMNS.values()], rows),
        "",
        "Ratios, each measured in this run:",
        "",
        C.md_table(["preset", *RATIO_COLUMNS.values()], rat),
    ]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mini-batches", type=int, default=1)
    ap.add_argument("--presets", nargs="+", default=["math_tiny_grpo", "math_tiny_ema_pg"])
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    args = ap.parse_args()
    os.environ.setdefault("EMAPG_PROGRESS", "0")
    machine = C.machine()
    results = {p: measure(p, args.iterations, args.threads, args.mini_batches) for p in args.presets}
    text = report(results, args, machine)
    print(text)
    if args.write:
        C.write_section("iteration_breakdown", text)


if __name__ == "__main__":
    main()
