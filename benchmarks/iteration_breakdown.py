"""Where an iteration of the local trainer spends its time, against the model's own raw operations.

    python benchmarks/iteration_breakdown.py [--iterations 12] [--threads 2] [--mini-batches 1] [--write]
    python benchmarks/iteration_breakdown.py --iterations 60 --eval-every 10 --probe-every 5 --write  # + spread
    python benchmarks/iteration_breakdown.py --presets search_tiny_grpo search_tiny_ema_pg --section NAME --write

Per preset, interleaved iteration by iteration on the same seed: the new path (``trainer.old_logprobs=rollout``,
pi_old's statistics from the sampler) and the old one (``recompute``, a no-grad pi_old pass). After every iteration
the batch is replayed through the model's raw operations at the same shapes and through ``model.generate``; every
figure is a ratio to those (the section explains each). ``--eval-every`` evaluates as a run does (untimed),
``--probe-every`` scores the KL probe (its time left out). On a multi-turn preset (search_tiny) the raw decode is
one turn as long as the longest response, not the rollout's work, so only the other ratios carry.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402

C.numerics.pin()  # before torch loads, as the emapg command does: the measured runs need its numerics pins

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from ema_pg_core.local.batch import collate  # noqa: E402
from ema_pg_core.local.trainer import LocalTrainer, seed_everything  # noqa: E402
from experiments import build, progress  # noqa: E402

PHASES = ("rollout", "reward", "logprob", "update", "anchor")
MODES = ("rollout", "recompute")  # the two pi_old paths
PRESETS = ["math_tiny_grpo", "math_tiny_ema_pg"]  # the acceptance measurement of the issue


def trainer(preset: str, mode: str, mini_batches: int, ckpt_dir: str, probe_every: int) -> LocalTrainer:
    """The trainer for the preset and pi_old mode, its last training rollout in `seen` (its first: `kept`)."""
    overrides = [f"experiment={preset}", f"trainer.old_logprobs={mode}", f"trainer.mini_batches={mini_batches}"]
    cfg = build.compose([*overrides, f"trainer.probe_every={probe_every}"])
    local, (policy, tok) = build.validate(cfg), build.model(cfg)
    seed_everything(int(cfg.seed))
    tr = LocalTrainer(policy, tok, build.task(cfg), local, ckpt_dir)
    tr.seen, tr.seen_prompts, tr.kept = [], [], []  # the last training rollout's trajectories and prompts

    def keep(model, prompts, *a, **kw):
        out = type(tr)._rollout(tr, model, prompts, *a, **kw)
        if kw.get("generator") is tr.gen:  # not an evaluation's or the probe's rollout
            tr.seen, tr.seen_prompts = out, prompts
        return out

    tr._rollout = keep
    return tr


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def raw_decode(model, tok, trajs, temperature: float, generator) -> None:
    """Prefill the same left-padded prompts, then decode as many steps as the rollout did (sampling only)."""
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


def hf_generate(model, tok, prompts: list[str], rc) -> int:
    """transformers' ``model.generate`` on the same prompts with the rollout's sampling settings (KV cache):
    tokenise (left padding), sample, decode the answers. Returns the decode steps it took (its own draws)."""
    gc = GenerationConfig(
        do_sample=True, temperature=rc.temperature, top_p=rc.top_p, top_k=0, max_new_tokens=rc.max_new_tokens,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    device = next(model.parameters()).device
    enc = tok(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt").to(device)
    with torch.no_grad():
        out = model.generate(**enc, generation_config=gc)
    tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out.shape[1] - enc["input_ids"].shape[1]


def raw_forward_backward(model, batch) -> None:
    """One forward + backward of the policy on the padded batch: log-softmax at the sampled tokens."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, L, V)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[..., None])  # (B, L, 1)
    (logp[..., 0] * batch.attention_mask).sum().backward()
    model.zero_grad(set_to_none=True)


def anchor_forward(model, batch) -> None:
    with torch.no_grad():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)


def raw_ops(tr, seen: list) -> dict:
    """Seconds of the model's raw operations on the batch `seen`: a KV-cache decode as long as its longest response
    (in the mode the rollout samples in), one forward + backward of the policy, one forward of the anchor."""
    batch = collate(seen, tr.tok.pad_token_id, device=tr.device)
    g = torch.Generator().manual_seed(0)  # the same draws every time: the decode's work does not depend on them
    mode = tr.policy.training
    tr.policy.eval()
    t_raw = _timed(lambda: raw_decode(tr.policy, tr.tok, seen, tr.cfg.rollout.temperature, g))
    tr.policy.train(mode)
    return {
        "raw_decode": t_raw,
        "raw_fwd_bwd": _timed(lambda: raw_forward_backward(tr.policy, batch)),
        "anchor_fwd": _timed(lambda: anchor_forward(tr.anchor.module, batch)) if tr.cfg.algo.kl.coef else 0.0,
    }


def replay(tr) -> dict:
    """Raw operations on the batch the trainer just sampled (seconds), the forward + backward once per optimizer
    step, and ``model.generate`` on its prompts."""
    gen_steps, mode = [], tr.policy.training
    tr.policy.eval()  # the mode the rollout samples in
    with torch.random.fork_rng(devices=[]):  # generate draws from torch's global generator: leave it as it was
        torch.manual_seed(tr.iteration)
        t_gen = _timed(lambda: gen_steps.append(hf_generate(tr.policy, tr.tok, tr.seen_prompts, tr.cfg.rollout)))
    tr.policy.train(mode)
    raw = raw_ops(tr, tr.seen)
    raw["raw_fwd_bwd"] *= tr.cfg.trainer.ppo_epochs * tr.cfg.trainer.mini_batches
    return {**raw, "generate": t_gen, "generate_steps": gen_steps[0]}


def step_and_replay(tr) -> dict:
    """One iteration of the trainer, then the raw operations replayed on its batch and (the fixed-work
    control: the floor under the trainer's own spread) on the batch `kept` from its first (warm-up) iteration."""
    t0 = time.perf_counter()
    m = tr.step()
    row = {"iter": time.perf_counter() - t0, "probe": m.get("perf/probe_s", 0.0)}
    row.update({p: m[f"perf/{p}_s"] for p in PHASES})
    steps = max(len(t.response_ids) for t in tr.seen)
    tr.kept = tr.kept or list(tr.seen)
    fixed = sum(raw_ops(tr, tr.kept).values())
    return {**row, "response_len": m["train/response_len"], "steps": steps, **replay(tr), "fixed": fixed}


def measure(preset: str, args) -> dict[str, list[dict]]:
    """{path: one row per iteration 2..N} for the new and the old path, interleaved in an order that rotates every
    iteration. With ``args.eval_every`` each path evaluates as a training run does (untimed)."""
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        trainers = {m: trainer(preset, m, args.mini_batches, f"{d}/{m}", args.probe_every) for m in MODES}
        rows: dict[str, list[dict]] = {m: [] for m in MODES}
        for it in range(args.iterations + 1):
            for mode in MODES[it % len(MODES) :] + MODES[: it % len(MODES)]:
                if it:
                    row = step_and_replay(trainers[mode])
                    if it > 1:  # the first iteration is warm-up
                        rows[mode].append(row)
                if args.eval_every and it % args.eval_every == 0:
                    trainers[mode].evaluate()
    return rows


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _p90_p10(xs: list[float]) -> float:
    """(p90 - p10) / median, the deciles within the data (one value: 0)."""
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else xs * 9
    return (q[-1] - q[0]) / statistics.median(xs)


def spread(rows: list[dict]) -> dict:
    """The spread of one path's iterations 2..N (the probe's time left out) and of its fixed-work control."""
    out = {"iter_p90_p10": _p90_p10([r["iter"] - r["probe"] for r in rows])}
    if len(rows) > 1:
        out["fixed_p90_p10"] = _p90_p10([r["fixed"] for r in rows])
    return out


PATHS = {"recompute": "old (recompute)", "rollout": "new (from the sampler)"}
PHASE_COLUMNS = {
    "response_len": "tokens / response",
    "rollout": "rollout",
    "reward": "rewards + batch",
    "logprob": "pi_old + anchor passes",
    "update": "update",
    "raw_decode": "raw decode",
    "generate": "model.generate",
    "steps": "decode steps",
    "generate_steps": "generate's steps",
    "raw_fwd_bwd": "raw fwd+bwd",
    "anchor_fwd": "anchor fwd",
    "fixed": "fixed-work control",
}
RATIO_COLUMNS = {  # column: its ratio of the medians of the new path (`n`) and the old (`o`)
    "rollout / model.generate": lambda n, o: n["rollout"] / n["generate"],
    "raw decode / model.generate": lambda n, o: n["raw_decode"] / n["generate"],
    "rollout / raw decode": lambda n, o: n["rollout"] / n["raw_decode"],
    "iteration / (raw decode + raw fwd+bwd + anchor fwd)": lambda n, o: (
        n["iter"] / (n["raw_decode"] + n["raw_fwd_bwd"] + n["anchor_fwd"])
    ),
    "old iteration / new iteration": lambda n, o: o["iter"] / n["iter"],
    "old rollout / raw decode": lambda n, o: o["rollout"] / o["raw_decode"],
}


def _cell(k: str, x: dict) -> str:
    """One table cell: counts as integers, spreads as percentages, seconds to 3 places."""
    if "steps" in k:
        return f"{x[k]:.0f}"
    return f"{x[k]:.1%}" if k.endswith("_p90_p10") else f"{x[k]:.3f}"


def report(results: dict, args, machine: dict) -> str:
    rows, rat, spr = [], [], []
    for preset, per_path in results.items():
        r = {mode: medians(rs) for mode, rs in per_path.items()}
        paths = []
        for mode, label in PATHS.items():
            x = r[mode]
            rows.append([preset, label, f"{x['iter']:.3f}", *(_cell(k, x) for k in PHASE_COLUMNS)])
            sp = spread(per_path[mode])
            fixed = f" ({_cell('fixed_p90_p10', sp)})" if "fixed_p90_p10" in sp else ""
            paths.append(f"{label} {_cell('iter_p90_p10', sp)}{fixed}")
        spr.append(f"{preset}: {', '.join(paths)}")
        rat.append([preset, *(f"{ratio(r['rollout'], r['recompute']):.2f}x" for ratio in RATIO_COLUMNS.values())])
    on = "" if args.presets == PRESETS else f" on {', '.join(args.presets)}"
    return "\n".join(
        [
            f"## Local-trainer iteration{on} vs the model's raw operations (`benchmarks/iteration_breakdown.py`)",
            "",
            f"Command: `{_command(args)}` (warm model cache; W&B off; medians over iterations 2..N).",
            C.machine_line(machine, args.threads),
            "",
            "Seconds per iteration (wall clock around `step()`) and phase, raw operations on the new path's batch; "
            "then the ratios:",
            "",
            C.md_table(["preset", "path", "iteration (s)", *PHASE_COLUMNS.values()], rows),
            "",
            C.md_table(["preset", *RATIO_COLUMNS], rat),
            "",
            "Spread, (p90 - p10) / median of the iteration less the KL probe over iterations 2..N, and in brackets "
            "that of the fixed-work control (the raw operations on one batch kept from the warm-up, after every "
            f"iteration): {'; '.join(spr)}.",
        ]
    )


def _command(args) -> str:
    extra = "" if args.presets == PRESETS else f" --presets {' '.join(args.presets)} --section {args.section}"
    cadence = f" --eval-every {args.eval_every} --probe-every {args.probe_every}"
    return (
        f"python benchmarks/iteration_breakdown.py --iterations {args.iterations} --threads {args.threads} "
        f"--mini-batches {args.mini_batches}{cadence}{extra} --write"
    )


def main() -> None:
    ap = C.cli(__doc__)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mini-batches", type=int, default=1)
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--section", default="iteration_breakdown", help="the docs/benchmarks.md section --write replaces")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N iterations, untimed (0: never)")
    ap.add_argument("--probe-every", type=int, default=0, help="this checkout's KL probe every N iterations (0: off)")
    args = ap.parse_args()
    if args.iterations < 2:  # the first iteration is warm-up: nothing would be left to report
        ap.exit(2, f"--iterations must be >= 2 (the first is warm-up); got {args.iterations}\n")
    os.environ.setdefault("EMAPG_PROGRESS", "0")
    progress.quiet_libraries()  # no progress bars of the model loads
    machine = C.machine()
    results = {p: measure(p, args) for p in args.presets}
    C.publish(args.section, report(results, args, machine), args.write)


if __name__ == "__main__":
    main()
