"""The embedded backend: EMA-PG (GRPO + EMA anchor + any KL estimator) on one HF causal LM.

One training iteration (docs/algorithm.md), read top to bottom in ``LocalTrainer.step``:
    1. rollout: prompts_per_iter prompts x group_size samples (tool loop for tool tasks)
    2. rewards and GRPO group advantages
    3. no-grad statistics: pi_old's (kept by the sampler while decoding, or from a forward pass:
       trainer.old_logprobs) and the anchor's, at pi_old's top-k (reverse Top-k) or its own (forward)
    4. ppo_epochs x mini_batches PPO steps: clipped surrogate + beta * KL(policy, anchor)
    5. anchor.update(iteration): EMA after iterations period, 2*period, ...
Evaluation (policy and anchor) runs before training and every eval_every iterations; checkpoints every
save_every iterations and on SIGTERM/SIGINT. Everything lives on ``trainer.device`` except the data order
(a per-epoch permutation drawn on the CPU, so it does not depend on the device).

Simplifications vs the paper's verl runs: one process, no sequence packing, no dynamic batch size, pi_old
is the policy before this iteration's update (as in the released code), the KL's importance weight uses
pi_old as pi_sampling (top-p truncation ignored, as in the code).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ema_pg_core.advantages import compute_advantages
from ema_pg_core.anchor import EmaAnchor
from ema_pg_core.config import (
    AlgoConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
    check_batch_split,
    check_seed,
    eval_problems,
)
from ema_pg_core.kl import KLInputs, get_estimator
from ema_pg_core.local import checkpoints
from ema_pg_core.local.batch import Batch, check_model, collate, forward_stats, sampler_stats
from ema_pg_core.local.device import resolve_device
from ema_pg_core.local.probe import make_probe, score_probe
from ema_pg_core.local.rollout import ToolEnv, Trajectory, rollout
from ema_pg_core.loss import policy_loss


class TrainerTask(Protocol):
    """The trainer's view of a task: its loaded splits, environment and scoring (experiments.tasks.TaskAdapter)."""

    name: str
    env: ToolEnv | None
    train: list[Any]  # examples with an ``id`` attribute
    test: list[Any]

    def prompt(self, example) -> str: ...
    def reward(self, example, response: str) -> float: ...
    def evaluate(self, example, response: str) -> int: ...


@dataclass
class LocalConfig:
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0
    """In [0, ema_pg_core.config.SEED_MAX]."""

    def __post_init__(self):
        check_seed("seed", self.seed)
        check_batch_split(self.rollout, self.trainer)


class Interrupted(RuntimeError):
    """Raised after a checkpoint was written in response to SIGTERM/SIGINT (``signame``)."""

    def __init__(self, message: str, signame: str):
        super().__init__(message)
        self.signame = signame


@dataclass
class Hooks:
    """How the trainer reports; experiments.run wires these to the run record and W&B."""

    metrics: Callable[[int, dict], None] = lambda it, m: None
    # after the update, before any evaluation of it: where a non-finite update is stopped (the health rules)
    step_end: Callable[[int, dict], None] = lambda it, m: None
    evals: Callable[[list[dict]], None] = lambda rows: None
    checkpoint: Callable[[int, Path], None] = lambda it, path: None
    iteration_end: Callable[[int, dict, Path | None], None] = lambda it, m, ckpt: None  # after any checkpoint of it
    state: Callable[[], dict] = dict  # extra state stored in each checkpoint (e.g. the record's clock)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class LocalTrainer:
    def __init__(
        self,
        policy,
        tokenizer,
        task: TrainerTask,
        cfg: LocalConfig,
        ckpt_dir: str | Path,
        *,
        hooks: Hooks | None = None,
    ):
        check_model(policy)
        self.device = resolve_device(cfg.trainer.device)
        policy.to(self.device)  # before the anchor copy and the optimizer: both follow the policy's device
        self.policy, self.tok, self.task, self.cfg = policy, tokenizer, task, cfg
        self.ckpt_dir, self.hooks = Path(ckpt_dir), hooks or Hooks()
        a, o = cfg.algo, cfg.optim
        self.est = get_estimator(a.kl.type)
        vocab = policy.get_output_embeddings().weight.shape[0]
        if self.est.needs == "topk" and a.kl.k > vocab:
            raise ValueError(f"algo.kl.k={a.kl.k} exceeds the model's vocabulary size {vocab}")
        self.anchor = EmaAnchor(policy, a.anchor)
        self.opt = torch.optim.AdamW(
            policy.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay
        )
        warm = max(1, o.warmup_iters * cfg.trainer.ppo_epochs * cfg.trainer.mini_batches)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm))
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed)  # sampling and mini-batch order
        self.iteration, self.data_pos = 0, (0, 0)  # (epoch, cursor) into the train split
        self._stop: str | None = None
        self.probe: dict[str, torch.Tensor] | None = None  # the KL probe set (local/probe.py), checkpointed

    # ------------------------------------------------------------------ data
    def next_examples(self) -> list:
        """prompts_per_iter training examples from a seeded per-epoch permutation."""
        n, want, out = len(self.task.train), self.cfg.rollout.prompts_per_iter, []
        epoch, cur = self.data_pos
        while len(out) < want:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch)).tolist()
            take = perm[cur : cur + want - len(out)]
            out += [self.task.train[i] for i in take]
            cur += len(take)
            if cur >= n:
                epoch, cur = epoch + 1, 0
        self.data_pos = (epoch, cur)
        return out

    # ------------------------------------------------------------------ rollout
    def _rollout(
        self, model, prompts: list[str], *, greedy=False, generator=None, temperature=None, stats_k=None
    ) -> list[Trajectory]:
        """Trajectories of `model` for `prompts`: at `temperature` (None: rollout.temperature; 0: greedy)."""
        r = self.cfg.rollout
        return rollout(
            model,
            self.tok,
            prompts,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature if temperature is None else temperature,
            top_p=1.0 if greedy else r.top_p,
            greedy=greedy,
            generator=generator,
            env=self.task.env,
            max_turns=r.max_turns,
            max_obs_tokens=r.max_obs_tokens,
            stats_k=stats_k,
        )

    # ------------------------------------------------------------------ the iteration
    def step(self) -> dict:
        """One training iteration; returns its metrics. Shapes: P prompts, G samples per prompt, B = P * G
        sequences, T response tokens (padded), L = prompt + response length, V vocabulary, k the Top-k size."""
        cfg = self.cfg
        it = self.iteration + 1
        if self.cfg.trainer.resolved_probe_every and self.probe is None:  # drawn once, by the initial policy
            self.probe = make_probe(self)
        t0 = time.perf_counter()
        # --- algorithm: rollout, rewards, advantages
        examples = self.next_examples()  # P examples
        G = cfg.rollout.group_size
        per_sample = [e for e in examples for _ in range(G)]  # B examples, each prompt G times in a row
        self.policy.eval()
        prompts = [self.task.prompt(e) for e in per_sample]
        trajs = self._rollout(self.policy, prompts, generator=self.gen, stats_k=self._sampler_k())  # B
        t_gen = time.perf_counter()
        scores = [self.task.reward(e, tr.text) for e, tr in zip(per_sample, trajs)]
        rewards = torch.tensor(scores, dtype=torch.float32, device=self.device)  # (B,)
        group = torch.arange(len(examples), device=self.device).repeat_interleave(G)  # (B,) prompt of each row
        adv = compute_advantages(rewards, group, cfg.algo.adv.mode, cfg.algo.adv.eps)  # (B,)
        batch = collate(trajs, self.tok.pad_token_id, dtype=torch.float32, device=self.device)  # (B, L), (B, T)
        t1 = time.perf_counter()
        # --- algorithm: pi_old and anchor statistics (no grad)
        # logp (B, T); head (B, T, k); logits (B, T, V) or None
        old, anc, anc_logits = self._reference_stats(batch, trajs)
        t2 = time.perf_counter()
        # --- algorithm: PPO updates with beta * KL to the anchor
        self.policy.train()
        upd = self._update(batch, adv, old, anc, anc_logits)
        t3 = time.perf_counter()
        # --- algorithm: EMA anchor
        updated = self.anchor.update(it, self.policy)
        t4 = time.perf_counter()
        self.iteration = it
        n_tok = float(batch.mask.sum())
        return {
            "train/reward": rewards.mean().item(),
            "train/reward_std": rewards.std().item(),
            "train/response_len": n_tok / len(trajs),
            "train/len_capped": float(np.mean([t.capped for t in trajs])),  # share cut at max_new_tokens
            "train/turns": float(np.mean([t.turns for t in trajs])),
            "train/entropy": float((old.entropy * batch.mask).sum() / batch.mask.sum().clamp_min(1)),
            "train/lr": self.sched.get_last_lr()[0],
            **upd,
            **self.anchor.drift(self.policy),
            "anchor/updated": float(updated),
            "perf/rollout_s": t_gen - t0,
            "perf/reward_s": t1 - t_gen,
            "perf/logprob_s": t2 - t1,
            "perf/update_s": t3 - t2,
            "perf/anchor_s": t4 - t3,
            "perf/iter_s": t4 - t0,
            **self._probe_metrics(it),  # kl/exact ... and perf/probe_s, every probe_every iterations
            "perf/tokens_per_s": float(batch.attention_mask.sum()) / (t4 - t0),
        }

    def _probe_metrics(self, it: int) -> dict:
        """kl/exact, kl/estimate_on_probe, kl/estimate_gap and perf/probe_s at iterations probe_every, 2*probe_every,
        ...; {} otherwise (also measured when beta = 0: the anchor still exists)."""
        tc, kl = self.cfg.trainer, self.cfg.algo.kl
        if not tc.resolved_probe_every or it % tc.resolved_probe_every:
            return {}
        t0 = time.perf_counter()
        m = score_probe(
            self.policy,
            self.anchor.module,
            self.probe,
            kl,
            agg=self.cfg.algo.loss.agg,
            temperature=self.cfg.rollout.temperature,
        )
        return {**m, "perf/probe_s": time.perf_counter() - t0}

    def _topk_plan(self) -> tuple[int, int]:
        """(k for pi_old's own top-k, k for the anchor's own top-k) by the estimator's capability."""
        if self.est.needs != "topk":
            return 0, 0
        return (self.cfg.algo.kl.k, 0) if self.est.direction == "reverse" else (0, self.cfg.algo.kl.k)

    def _sampler_k(self) -> int | None:
        """pi_old's top-k size when its statistics come from the sampler (trainer.old_logprobs), else None."""
        return self._topk_plan()[0] if self.cfg.trainer.old_logprobs in ("auto", "rollout") else None

    @torch.no_grad()
    def _reference_stats(self, batch: Batch, trajs: list[Trajectory]):
        kl, T = self.cfg.algo.kl, self.cfg.rollout.temperature
        k_old, k_anc = self._topk_plan()
        self.policy.eval()
        if self._sampler_k() is None:
            old, _ = forward_stats(self.policy, batch, k=k_old, temperature=T, fused=kl.fused, entropy=True)
        else:  # the same pi_old, from the decode's logits (KV cache): equal up to float rounding
            old = sampler_stats(trajs, self.device)
        if kl.coef == 0:
            return old, None, None
        idx = old.indices if (self.est.needs == "topk" and self.est.direction == "reverse") else None
        anc, anc_logits = forward_stats(
            self.anchor.module,
            batch,
            k=k_anc,
            indices=idx,
            temperature=T,
            fused=kl.fused,
            full_logits=self.est.needs == "full",
        )
        return old, anc, anc_logits

    def _update(self, batch: Batch, adv, old, anc, anc_logits) -> dict:
        cfg, kl = self.cfg, self.cfg.algo.kl
        B, stats = batch.tokens.shape[0], []
        head_idx = None  # (B, T, k): the Top-k head, pi_old's (reverse KL) or the anchor's (forward KL)
        if self.est.needs == "topk" and anc is not None:
            head_idx = old.indices if self.est.direction == "reverse" else anc.indices
        for _ in range(cfg.trainer.ppo_epochs):
            perm = torch.randperm(B, generator=self.gen, device=self.device)  # (B,)
            for rows in perm.chunk(cfg.trainer.mini_batches):  # (b,) row ids of one mini-batch
                mb = batch.select(rows)  # tokens and mask (b, T)
                # logp (b, T); logits_k (b, T, k) on head_idx; lse (b, T); cur_logits (b, T, V) only for exact KLs
                cur, cur_logits = forward_stats(
                    self.policy,
                    mb,
                    indices=None if head_idx is None else head_idx[rows],
                    temperature=cfg.rollout.temperature,
                    fused=kl.fused,
                    entropy=cfg.algo.loss.entropy_coef > 0,
                    full_logits=self.est.needs == "full" and anc is not None,
                )
                x = None  # the KL term's inputs, every tensor (b, T) or (b, T, k) / (b, T, V)
                if anc is not None:
                    x = KLInputs(
                        logp=cur.logp,
                        ref_logp=anc.logp[rows],
                        old_logp=old.logp[rows],
                        sampled=mb.tokens,
                        topk_idx=cur.indices,
                        logits_k=cur.logits_k,
                        lse=cur.lse,
                        ref_logits_k=anc.logits_k[rows],
                        ref_lse=anc.lse[rows],
                        logits=cur_logits,
                        ref_logits=None if anc_logits is None else anc_logits[rows],
                    )
                loss, st = policy_loss(  # scalar: PPO-clip surrogate + beta * KL (- entropy bonus), aggregated
                    cur.logp,
                    old.logp[rows],
                    adv[rows],
                    mb.mask,
                    x,
                    loss_cfg=cfg.algo.loss,
                    kl_cfg=kl,
                    entropy=cur.entropy,
                )
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                st["train/grad_norm"] = float(
                    torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.optim.grad_clip)
                )
                self.opt.step()
                self.sched.step()
                stats.append(st)
        return {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> tuple[dict, list[dict]]:
        """Greedy accuracy and pass@1 (mean over eval_n samples at trainer.eval_temperature; 0 = greedy, so each
        sample is the greedy answer) for the policy and the anchor."""
        tc, name = self.cfg.trainer, self.task.name
        exs = self.task.test[: eval_problems(tc, len(self.task.test))]
        metrics, rows, cache = {}, [], None
        for who, model in (("policy", self.policy), ("anchor", self.anchor.module)):
            if who == "anchor" and self.iteration == 0:
                res = cache  # identical weights before any update
            else:
                model.eval()
                g = torch.Generator(device=self.device).manual_seed(self.cfg.seed * 1_000_003 + self.iteration)
                prompts = [self.task.prompt(e) for e in exs]
                greedy = self._rollout(model, prompts, greedy=True)
                if tc.eval_temperature == 0:  # greedy samples: the greedy answers, n times (decoded once)
                    sampled = [t for t in greedy for _ in range(tc.eval_n)]
                else:
                    n_prompts = [p for p in prompts for _ in range(tc.eval_n)]
                    sampled = self._rollout(model, n_prompts, generator=g, temperature=tc.eval_temperature)
                n_exs = [e for e in exs for _ in range(tc.eval_n)]
                res = cache = (
                    [self.task.evaluate(e, t.text) for e, t in zip(exs, greedy)],
                    np.array([self.task.evaluate(e, t.text) for e, t in zip(n_exs, sampled)]).reshape(
                        len(exs), tc.eval_n
                    ),
                )
            g_ok, s_ok = res
            prefix = "eval" if who == "policy" else "eval_anchor"
            metrics[f"{prefix}/{name}/acc"] = float(np.mean(g_ok))
            metrics[f"{prefix}/{name}/pass@1"] = float(s_ok.mean())
            rows += [
                {
                    "iteration": self.iteration,
                    "model": who,
                    "benchmark": name,
                    "problem_id": str(e.id),
                    "n": tc.eval_n,
                    "n_correct": int(s.sum()),
                    "greedy_correct": int(g1),
                }
                for e, g1, s in zip(exs, g_ok, s_ok)
            ]
        self.policy.train()
        return metrics, rows

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "iteration": self.iteration,
            "data_pos": self.data_pos,
            "policy": self.policy.state_dict(),
            "anchor": self.anchor.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng": {
                "device": self.device.type,
                "gen": self.gen.get_state(),
                "torch": torch.get_rng_state(),
                **({"cuda": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
            "hooks": self.hooks.state(),
            "probe": self.probe,
        }

    def load_state_dict(self, s: dict) -> None:
        rng = s["rng"]
        saved = rng.get("device", "cpu")  # checkpoints without the key were written on cpu
        if saved != self.device.type:
            raise ValueError(
                f"checkpoint was written with trainer.device={saved}; its sampling state cannot "
                f"continue on {self.device.type}: resume with trainer.device={saved}"
            )
        self.policy.load_state_dict(s["policy"])
        self.anchor.load_state_dict(s["anchor"])
        self.opt.load_state_dict(s["optimizer"])
        self.sched.load_state_dict(s["scheduler"])
        self.gen.set_state(rng["gen"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self.iteration, self.data_pos = int(s["iteration"]), tuple(s["data_pos"])
        self.probe = s.get("probe")

    def save(self) -> Path:
        """Atomically write checkpoints/iter_<N>/state.pt and the ``latest`` pointer; prune old ones."""
        final = checkpoints.step_dir(self.ckpt_dir, self.iteration)
        tmp = self.ckpt_dir / f".tmp_{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            with open(tmp / "state.pt", "wb") as f:
                torch.save(self.state_dict(), f)
        except (OSError, RuntimeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)  # no partial checkpoint left (and its space back)
            # torch's zip writer turns the file's OSError (a full disk: ENOSPC) into a RuntimeError around it
            cause = e if isinstance(e, OSError) else e.__context__
            if not isinstance(cause, OSError):
                raise
            raise OSError(cause.errno, cause.strerror, str(tmp / "state.pt")) from e
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        checkpoints.point_latest(self.ckpt_dir, final)
        for old in sorted(self.ckpt_dir.glob("iter_*"))[: -self.cfg.trainer.keep_checkpoints]:  # >= 1 (TrainerConfig)
            shutil.rmtree(old, ignore_errors=True)
        self.hooks.checkpoint(self.iteration, final)
        return final

    @staticmethod
    def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
        """The checkpoint to resume from first (see ``checkpoints.load_newest`` for one that loads), or None."""
        found = checkpoints.candidates(ckpt_dir)
        return found[0] if found else None

    def resume(self, path: str | Path) -> int:
        """Load a checkpoint onto the configured device; returns its iteration. Loaded to host memory first
        (RNG states must stay CPU byte tensors; no second copy of the model in device memory)."""
        state = torch.load(Path(path) / "state.pt", weights_only=False, map_location="cpu")
        self.load_state_dict(state)
        return self.iteration

    # ------------------------------------------------------------------ the loop (plumbing)
    def _on_signal(self, signum, frame):
        self._stop = signal.Signals(signum).name

    def train(self) -> dict:
        """Run to cfg.trainer.iterations, from self.iteration (0, or a resumed checkpoint)."""
        tc = self.cfg.trainer
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if self.iteration == 0:
                m, rows = self.evaluate()
                self.hooks.evals(rows)
                self.hooks.metrics(0, m)
            last = {}
            while self.iteration < tc.iterations:
                m = self.step()
                self.hooks.step_end(self.iteration, m)
                if self.iteration % tc.eval_every == 0 or self.iteration == tc.iterations:
                    em, rows = self.evaluate()
                    m.update(em)
                    self.hooks.evals(rows)
                self.hooks.metrics(self.iteration, m)
                last = m
                ckpt = None
                if (
                    self._stop
                    or (tc.save_every and self.iteration % tc.save_every == 0)
                    or self.iteration == tc.iterations
                ):
                    ckpt = self.save()
                self.hooks.iteration_end(self.iteration, m, ckpt)
                if self._stop:
                    raise Interrupted(
                        f"interrupted by {self._stop} after iteration {self.iteration}; checkpoint saved in {ckpt}",
                        self._stop,
                    )
            return last
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
