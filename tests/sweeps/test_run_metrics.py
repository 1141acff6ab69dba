"""sweeps.spec.RUN_METRICS and EVAL_METRICS are exactly the keys the local trainer logs (one tiny iteration)."""

from dataclasses import dataclass

import torch

from ema_pg_core.config import AlgoConfig, AnchorConfig, KLConfig, RolloutConfig, TrainerConfig
from ema_pg_core.local.tiny import build_model, build_tokenizer
from ema_pg_core.local.trainer import LocalConfig, LocalTrainer
from sweeps.spec import EVAL_METRICS, RUN_METRICS


@dataclass
class Ex:
    id: int
    q: str
    a: str


class Toy:
    """Answer the next digit: '3>' -> '4'."""

    name, env = "toy", None

    def __init__(self):
        self.train = [Ex(i, str(i % 10), str((i + 1) % 10)) for i in range(8)]
        self.test = self.train[:2]

    def prompt(self, e):
        return f"{e.q}>"

    def reward(self, e, r):
        return float(r[:1] == e.a)

    def evaluate(self, e, r):
        return int(r[:1] == e.a)


def test_run_metrics_are_the_keys_one_local_iteration_logs(tmp_path):
    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = LocalConfig(
        algo=AlgoConfig(kl=KLConfig(k=4), anchor=AnchorConfig(tau=0.5, period=1)),  # KL on: kl/value
        rollout=RolloutConfig(max_new_tokens=2, prompts_per_iter=2, group_size=2),
        trainer=TrainerConfig(iterations=1, eval_size=2, eval_n=1, mini_batches=1),
        seed=0,
    )
    trainer = LocalTrainer(build_model(tok, hidden=16, layers=1, heads=2, seed=0), tok, Toy(), cfg, tmp_path)
    logged = trainer.step()
    assert sorted(logged) == sorted(RUN_METRICS), set(logged) ^ set(RUN_METRICS)
    evals, _ = trainer.evaluate()
    assert sorted(evals) == sorted(f"{ns}/toy/{m}" for ns in ("eval", "eval_anchor") for m in EVAL_METRICS)
