"""verl's ActorRolloutRefWorker + the EMA anchor: update on local shards, checkpoint, resume.

In verl 0.9.1 one Ray worker process holds the actor and the reference (``self.actor``, ``self.ref``,
``TrainingWorker``s with FSDP2 engines) for role ``actor_rollout_ref``; the reference *is* the EMA anchor.
The anchor is saved to ``global_step_N/anchor`` (with ``emapg_anchor.json``) beside verl's actor, and on
resume a missing anchor is an error, never a silent restart from the initial model (what the released code
and stock verl do). Retention applies to whole ``global_step_N`` directories, judged from what is on disk:
verl's own pruning only remembers the saves of the current process, so it is switched off in favour of ours.

The trainer passes the ``emapg:`` section as ``actor_rollout_ref.emapg``. Methods other than the RPC wrappers
take no Ray state, so tests call them on an object carrying ``.actor``/``.ref`` built outside Ray.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from functools import partial

import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.trainer.config import CheckpointConfig
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.workers.engine_workers import ActorRolloutRefWorker

from experiments.backends.verl.config import EmaPGSection, uses_topk
from experiments.backends.verl.ema import drift, ema_update_sharded_, paired_local_shards, wait_for_offload
from experiments.backends.verl.engine import reclass
from experiments.backends.verl.evals import load_anchor_, restore_actor_
from experiments.backends.verl.loss import emapg_actor_loss
from experiments.backends.verl.probe import PROBE_FILE, score

ANCHOR_DIR = "anchor"
ANCHOR_META = "emapg_anchor.json"
TRACKER = "latest_checkpointed_iteration.txt"  # verl's trainer writes it after each complete save
_STEP_DIR = re.compile(r"global_step_(0|[1-9][0-9]*)")  # the names verl's trainer gives (no zero padding)

logger = logging.getLogger(__name__)


def _beside(actor_path: str, name: str) -> str:
    """``.../global_step_N/actor`` -> ``.../global_step_N/<name>`` (the anchor's directory, the KL probe's file)."""
    return os.path.join(os.path.dirname(os.path.normpath(actor_path)), name)


def step_of(name: str) -> int | None:
    """``"global_step_12"`` -> 12; None for any other name."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def step_dirs_to_remove(
    names: Iterable[str], current: int, keep: int | None, protected: int | None = None
) -> list[str]:
    """The ``global_step_N`` names to delete so that the newest ``keep`` steps up to ``current`` remain, oldest
    first; none when ``keep`` sets no limit (None, 0, negatives or a non-int, as in verl).

    ``current`` (just written) and ``protected`` (the tracker file's step, the last complete save) stay: the
    trainer moves the tracker only after the worker returns. Steps above ``current`` belong to a run that
    resumed from an earlier step and are left to be overwritten."""
    if not (keep and isinstance(keep, int) and keep > 0):
        return []
    steps = {s: n for n in names if (s := step_of(n)) is not None and s <= current}
    newest = sorted(set(steps) | {current}, reverse=True)[:keep]
    spared = set(newest) | {current, protected}
    return [steps[s] for s in sorted(steps) if s not in spared]


def step_layout(actor_path: str) -> tuple[str, int] | None:
    """``<root>/global_step_N/actor`` -> (root, N); None when the path has another layout."""
    step_dir = os.path.dirname(os.path.normpath(actor_path))
    step = step_of(os.path.basename(step_dir))
    return None if step is None else (os.path.dirname(step_dir), step)


def _tracked_step(root: str) -> int | None:
    """The step in ``<root>/latest_checkpointed_iteration.txt``; None if missing or unreadable."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def remove_old_step_dirs(root: str, current: int, keep: int | None) -> list[str]:
    """Deletes what ``step_dirs_to_remove`` picks under ``root``; returns the names. Safe to repeat: a
    half-deleted directory is picked again next time."""
    names = [n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))]
    doomed = step_dirs_to_remove(names, current, keep, _tracked_step(root))
    for name in doomed:
        logger.info("checkpoint retention (keep %s): removing %s", keep, os.path.join(root, name))
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return doomed


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


class EmaPGActorRolloutRefWorker(ActorRolloutRefWorker):
    """``ActorRolloutRefWorker`` whose reference is the EMA anchor (see the module docstring)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        if "emapg" not in self.config:
            raise ValueError(
                "actor_rollout_ref.emapg is missing: launch through experiments.backends.verl.main (trainer emapg_sync)"
            )
        section = EmaPGSection.from_config(self.config.emapg)
        if self.role != "actor_rollout_ref":
            raise ValueError(
                f"EMA-PG needs the actor and a separate reference in one worker (role actor_rollout_ref); "
                f"got role {self.role!r}. LoRA (ref_in_actor) has no separate reference to average."
            )
        super().init_model()
        self.emapg_setup(section)

    # ------------------------------------------------------------------ setup (no Ray state)
    def emapg_setup(self, section: EmaPGSection) -> None:
        """Engines, loss, anchor checkpoint manager; validates what local-shard EMA needs."""
        if self.ref is None or self.actor is None:
            raise ValueError("EMA-PG needs both an actor and a separate reference model")
        for name, w in (("actor", self.actor), ("ref", self.ref)):
            if w.engine_config.strategy != "fsdp2":
                raise ValueError(
                    f"{name} strategy is {w.engine_config.strategy!r}; EMA on local shards needs "
                    "actor_rollout_ref.actor.strategy=fsdp2 (FSDP1 flat parameters do not line up)"
                )
        if section.anchor.tau < 1.0 and self.ref.engine_config.model_dtype not in ("fp32", "float32"):
            raise ValueError(
                f"actor_rollout_ref.ref.fsdp_config.model_dtype={self.ref.engine_config.model_dtype!r}: with "
                f"tau={section.anchor.tau} a low-precision anchor rounds (1 - tau) steps away; use fp32"
            )
        if getattr(self, "distillation_enabled", False):
            raise ValueError("EMA-PG's loss replaces verl's; distillation must be off")
        reclass(self.actor.engine)
        reclass(self.ref.engine)
        actor_config = self.loss_fn.keywords["config"]  # verl's partial(ppo_loss, config=ActorConfig)
        self.loss_fn = partial(emapg_actor_loss, config=actor_config, kl=section.kl, loss=section.loss)
        self.actor.set_loss_fn(self.loss_fn)
        if uses_topk(section.kl):
            # R3: flash-attn's in-place cross-entropy backward overwrites the logits the Top-k
            # backward recomputes from; the pure-torch log-prob path leaves them intact.
            os.environ["VERL_DISABLE_FLASH_ATTN_CE"] = "1"
        self.ref.engine.checkpoint_manager = FSDPCheckpointManager(
            model=self.ref.engine.module,
            optimizer=None,
            lr_scheduler=None,
            processing_class=self.ref.engine.model_config.get_processor(),
            checkpoint_config=CheckpointConfig(save_contents=["model"], load_contents=["model"]),
        )
        self._emapg = section
        self._anchor_updates = 0
        self._probe = None  # {"data": TensorDict, "logp": [(T_i,)]}: the KL probe (experiments.backends.verl.probe)

    # ------------------------------------------------------------------ the EMA
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_ref_ema(self, iteration: int) -> dict[str, float]:
        """anchor <- tau*anchor + (1-tau)*actor on every rank's shards; returns anchor/* metrics."""
        wait_for_offload()
        ema_update_sharded_(self.ref.engine.module, self.actor.engine.module, self._emapg.anchor.tau)
        self._anchor_updates += 1
        _barrier()
        return {
            **drift(self.ref.engine.module, self.actor.engine.module),
            "anchor/num_updates": float(self._anchor_updates),
            "anchor/updated": 1.0,
            "anchor/tau": self._emapg.anchor.tau,
            "anchor/last_iteration": float(iteration),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def anchor_in_actor(self, on: bool) -> None:
        """on: the actor holds the anchor's weights (its own kept aside in host memory), so that verl's
        weight sync sends the anchor to the rollout engine for its evaluation; off: the actor's restored."""
        wait_for_offload()
        anchor, actor = paired_local_shards(self.ref.engine.module, self.actor.engine.module)
        if on:
            self._actor_aside = load_anchor_(actor, anchor)
        elif getattr(self, "_actor_aside", None) is not None:
            restore_actor_(actor, self._actor_aside)
            self._actor_aside = None
        _barrier()

    # ------------------------------------------------------------------ the KL probe
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def capture_probe(self, data) -> int:
        """Keep ``data`` (the probe's rows; every rank gets all of them) and the policy's log-probs of them as
        pi_probe; a probe already held (loaded with a checkpoint) is kept instead. Returns its size."""
        if self._probe is None:
            probe = data.select(*[k for k, v in data.items() if isinstance(v, torch.Tensor)])
            _, logp = score(self.actor, self.ref, probe, **self._probe_args())
            self._probe = {"data": probe, "logp": logp}
        return len(self._probe["logp"])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def score_probe(self) -> dict[str, float]:
        """kl/exact, kl/estimate_on_probe and kl/estimate_gap of the current policy and anchor on the probe."""
        if self._probe is None:
            raise RuntimeError("score_probe before capture_probe: the trainer captures the probe at its first step")
        probe = self._probe
        metrics, _ = score(self.actor, self.ref, probe["data"], probe_logp=probe["logp"], **self._probe_args())
        return metrics

    def _probe_args(self) -> dict:
        rollout_t = self.config.rollout.temperature
        return {"kl": self._emapg.kl, "agg": self._emapg.loss.agg, "temperature": float(rollout_t)}

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        """Actor (verl), then the anchor beside it, then retention over whole ``global_step_N`` dirs. With the
        trainer's layout verl's managers get no limit: with 1 they would delete the actor the tracker still names."""
        layout = step_layout(local_path)
        verl_keep = max_ckpt_to_keep if layout is None else None
        super().save_checkpoint(local_path, hdfs_path, global_step, verl_keep)
        if self._emapg.anchor.tau < 1.0:  # a fixed anchor is the initial model, which the run config names
            self._save_anchor(_beside(local_path, ANCHOR_DIR), global_step, verl_keep)
        if self._probe is not None and _rank() == 0:
            path = _beside(local_path, PROBE_FILE)
            torch.save(self._probe, path + ".tmp")
            os.replace(path + ".tmp", path)
        if layout is not None and _rank() == 0:
            remove_old_step_dirs(layout[0], layout[1], max_ckpt_to_keep)
        _barrier()

    def _save_anchor(self, path: str, global_step: int, keep: int | None) -> None:
        """The anchor's shards, then (rank 0) ``emapg_anchor.json``, whose presence marks it complete."""
        self.ref.save_checkpoint(path, None, global_step, keep)
        if _rank() == 0:
            meta = {
                "tau": self._emapg.anchor.tau,
                "period": self._emapg.anchor.period,
                "num_updates": self._anchor_updates,
                "global_step": int(global_step),
            }
            tmp = os.path.join(path, ANCHOR_META + ".tmp")
            with open(tmp, "w") as f:
                json.dump(meta, f)
            os.replace(tmp, os.path.join(path, ANCHOR_META))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        path = _beside(local_path, ANCHOR_DIR)
        meta_path = os.path.join(path, ANCHOR_META)
        if self._emapg.anchor.tau < 1.0 and not os.path.isfile(meta_path):
            raise FileNotFoundError(
                f"resuming EMA-PG (tau={self._emapg.anchor.tau}) from {local_path}, but the EMA anchor is not beside "
                f"it ({meta_path} missing). Refusing to restart the anchor from the initial model. Resume from a "
                "checkpoint written by emapg, or start a new run (trainer.resume_mode=disable)."
            )
        super().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        if self._emapg.anchor.tau < 1.0:
            self.ref.load_checkpoint(path, None, False)
            with open(meta_path) as f:
                self._anchor_updates = int(json.load(f)["num_updates"])
        probe = _beside(local_path, PROBE_FILE)
        if os.path.isfile(probe):  # else (a checkpoint written without the probe) the next step captures one
            self._probe = torch.load(probe, weights_only=False)
        _barrier()
