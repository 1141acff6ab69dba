"""The actor update's loss pass with the Top-k KL against the same pass with K3, on verl's engine alone.

    python benchmarks/verl_loss_pass.py [--repeats 30] [--write]

verl 0.9's FSDP2 training engine on its CPU platform, in this process (a gloo group of size 1), with the plugin's
engine and loss: the tiny Qwen2 of the verl tests (2 layers, hidden 64, 100-token vocabulary) and their batch of 4
sequences in one micro-batch (``experiments.backends.verl.standalone``). One pass is what verl's update runs per
micro-batch: forward with the loss, backward, no optimizer step. The variants run interleaved, medians after 3
warm-up passes:

- K3 (``algo.kl.type=k3``): no logits hook, no Top-k field read;
- reverse Top-k, k = 32 (the search recipe's KL): the logits hook computes the Top-k KL and its telemetry from the
  fields pi_old's and the anchor's passes left in the batch (run once, before the timing).

Their difference is the per-micro-batch cost of the Top-k KL in verl's update, apart from the step's other work
(generation, the passes, the transfers: ``benchmarks/verl_overhead.py``). On a model this small it is mostly fixed
cost per micro-batch (Python, tensor dispatch), which a real model's work dwarfs. ``--write`` replaces the
"verl_loss_pass" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import machine, machine_line, md_table, write_section  # noqa: E402
from ema_pg_core.config import KLConfig, LossConfig  # noqa: E402
from experiments.backends.verl import cpu, require_verl  # noqa: E402
from experiments.backends.verl import standalone as engines  # noqa: E402

K = 32
WARMUP = 3


def engines_pair(tmp: str):
    """(actor, anchor): verl's FSDP2 engines with the plugin's engine class, the anchor perturbed off the policy."""
    cpu.install()
    cpu.init_gloo()
    return engines.actor_and_anchor(engines.save_tiny(Path(tmp) / "model"))


def topk_fields(actor, ref, kl) -> dict:
    """The fields pi_old's pass (the head ids) and the anchor's pass (its log-probs there) add to the batch."""
    from experiments.backends.verl.config import topk_passes  # loads pydantic

    return engines.pass_fields(actor, ref, topk_passes(kl))[1]


def update_pass(actor, kl, fields: dict) -> float:
    """Seconds of one forward-backward of the actor's loss over the batch (verl's update, one micro-batch)."""
    from verl.workers.config import FSDPActorConfig

    from experiments.backends.verl.engine import set_pass  # loads verl, after main's require_verl
    from experiments.backends.verl.loss import emapg_actor_loss  # loads verl, after main's require_verl

    cfg = FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False, rollout_n=1
    )
    loss_fn = partial(emapg_actor_loss, config=cfg, kl=kl, loss=LossConfig(agg="token-mean"))
    td, _ = engines.batch(temperature=0.8)
    td.update(fields)
    set_pass(td, "train" if fields else "off")
    engines.train_flags(td)
    actor.engine.optimizer_zero_grad()
    t = time.perf_counter()
    with actor.engine.train_mode():
        actor.engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)
    t = time.perf_counter() - t
    actor.engine.optimizer_zero_grad()
    return t


def measure(repeats: int) -> dict[str, list[float]]:
    """{variant: seconds per pass after the warm-up}, the variants interleaved."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        actor, ref = engines_pair(tmp)
        topk = KLConfig(type="topk_reverse", k=K, tail="paper", coef=0.5, use_iw=True)
        variants = {"K3": (KLConfig(type="k3", coef=0.5), {}), f"reverse Top-k, k = {K}": (topk, {})}
        variants[f"reverse Top-k, k = {K}"][1].update(topk_fields(actor, ref, topk))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(WARMUP + repeats):
            for name, (kl, fields) in variants.items():
                t = update_pass(actor, kl, fields)
                if r >= WARMUP:
                    times[name].append(t)
    return times


def report(times: dict[str, list[float]], repeats: int) -> str:
    base = statistics.median(next(iter(times.values())))
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        q = statistics.quantiles(ts, n=4)
        rows.append([name, f"{med * 1e3:.1f}", f"{q[0] * 1e3:.1f} to {q[-1] * 1e3:.1f}", f"{med / base:.2f}x",
                     f"{(med - base) * 1e3:+.1f}"])  # fmt: skip
    head = ["variant", "median (ms)", "interquartile (ms)", "/ K3", "over K3 (ms)"]
    return "\n".join([
        "## The Top-k KL in verl's update pass, on the engine alone (`benchmarks/verl_loss_pass.py`)",
        "",
        f"Command: `python benchmarks/verl_loss_pass.py --repeats {repeats} --write`: one micro-batch of 4 sequences "
        f"(tiny Qwen2, verl's FSDP2 engine on CPU, one thread), forward with the loss and backward, {repeats} passes "
        "per variant interleaved after 3 warm-up passes.",
        machine_line(machine(), 1),
        "",
        md_table(head, rows),
    ])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--write", action="store_true", help="replace the verl_loss_pass section of docs/benchmarks.md")
    args = p.parse_args()
    if args.repeats < 2:
        p.exit(2, f"--repeats must be >= 2; got {args.repeats}\n")
    try:
        require_verl()
    except ImportError as e:  # one line, no traceback: run it in the venv that has the [verl] extra
        p.exit(2, f"{e}\n")
    text = report(measure(args.repeats), args.repeats)
    print(text)
    if args.write:
        write_section("verl_loss_pass", text)


if __name__ == "__main__":
    main()
