"""Bias or noise? The KL probe of a finished local run, with the estimator's expectation by exact enumeration.

    python benchmarks/probe_enumeration.py RUN_DIR [RUN_DIR ...]

For each run record (local backend, tiny vocabulary), loads the last checkpoint's policy, anchor and probe
set and prints, aggregated over the probe's response tokens as the run's loss aggregates the KL:

    exact       the exact KL in the estimator's direction (what the run logged as kl/exact)
    expected    E_{p ~ pi}[estimate] at every probe position, by summing over the whole vocabulary
                (pi(p) times the estimator's value had p been sampled; s = 1)
    sampled     the estimator on the probe's own tokens with s = pi / pi_probe (the run's kl/estimate_on_probe)

expected - exact is the estimator's bias at these positions; sampled - expected is the sampling noise of one
draw per position. O(V) rows per position: meant for the tiny models (V = 100), not for a real vocabulary.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from experiments import numerics

numerics.pin()  # before torch loads, as the emapg command does: build.model checks the pins of the model it builds

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from ema_pg_core.kl import ImportanceWeight, KLInputs, aggregate, get_estimator, kl_per_token  # noqa: E402
from ema_pg_core.local import checkpoints  # noqa: E402
from ema_pg_core.local.batch import response_hidden  # noqa: E402
from ema_pg_core.local.probe import probe_batch, score_probe  # noqa: E402
from experiments import build  # noqa: E402


def _load(run: Path):
    cfg = OmegaConf.load(run / "config.yaml")
    torch.set_num_threads(int(cfg.trainer.threads))  # as the run: its warm start's cache key holds the threads
    policy, _ = build.model(cfg)
    anchor = copy.deepcopy(policy)
    _, state, _ = checkpoints.load_newest(run / "checkpoints")
    policy.load_state_dict(state["policy"])
    anchor.load_state_dict(state["anchor"]["module"])
    return cfg, policy.double().eval(), anchor.double().eval(), state["probe"]


def _every_token_inputs(z, zr, k: int, direction: str):
    """KLInputs with one row per (position, candidate token): (N, V) from logits (N, V) of both models."""
    N, V = z.shape
    lp, lr = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    idx = torch.topk(z if direction == "reverse" else zr, k, -1).indices[:, None, :].expand(N, V, k)  # (N, V, k)
    rep = lambda t: t[:, None].expand(N, V)  # noqa: E731  (N,) -> (N, V)
    return KLInputs(
        logp=lp, ref_logp=lr, old_logp=None, sampled=torch.arange(V).expand(N, V), topk_idx=idx,
        logits_k=z[:, None, :].expand(N, V, V).gather(-1, idx), lse=rep(torch.logsumexp(z, -1)),
        ref_logits_k=zr[:, None, :].expand(N, V, V).gather(-1, idx), ref_lse=rep(torch.logsumexp(zr, -1)),
    ), lp  # fmt: skip


def enumerate_run(run: Path) -> dict[str, float]:
    cfg, policy, anchor, probe = _load(run)
    kl, T = cfg.algo.kl, float(cfg.rollout.temperature)
    est = get_estimator(kl.type)
    if est.needs == "full":
        raise SystemExit(f"{run}: {kl.type} is exact; nothing to enumerate")
    logged = score_probe(policy, anchor, {k: v.double() if v.is_floating_point() else v for k, v in probe.items()},
                         kl, agg=cfg.algo.loss.agg, temperature=T)  # fmt: skip
    batch = probe_batch(probe, "cpu")
    with torch.no_grad():
        z = (policy.get_output_embeddings()(response_hidden(policy, batch)) / T).flatten(0, 1)  # (N, V)
        zr = (anchor.get_output_embeddings()(response_hidden(anchor, batch)) / T).flatten(0, 1)
        x, lp = _every_token_inputs(z, zr, kl.k, est.direction)
        per = kl_per_token(kl.type, x, tail=kl.tail, iw=ImportanceWeight())  # (N, V)
    expected = (lp.exp() * per).sum(-1).view(batch.mask.shape)  # (P, T)
    agg = lambda t: float(aggregate(t, batch.mask.double(), cfg.algo.loss.agg))  # noqa: E731
    return {"exact": logged["kl/exact"], "expected": agg(expected), "sampled": logged["kl/estimate_on_probe"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    print("| run | estimator | exact | expected (enumerated) | sampled (probe tokens) |")
    print("|---|---|---|---|---|")
    for run in args.runs:
        kl = OmegaConf.load(run / "config.yaml").algo.kl
        r = enumerate_run(run)
        name = kl.type + (f" k={kl.k} {kl.tail}" if kl.type.startswith("topk") else "")
        print(f"| {run.name} | {name} | {r['exact']:.5f} | {r['expected']:.5f} | {r['sampled']:.5f} |")


if __name__ == "__main__":
    main()
