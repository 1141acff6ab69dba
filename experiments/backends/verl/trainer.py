"""verl's V1 synchronous trainer + EMA-PG: Top-k passes and the EMA anchor schedule.

Registered as ``trainer.v1.trainer_mode=emapg_sync``. Per iteration (verl's ``_step_once``):

    rollout -> reward -> pi_old pass [Top-k "old" flags] -> anchor pass [Top-k "ref" flags]
            -> GRPO advantages -> actor update [Top-k "train" flags; with emapg.mask_truncated, the length cap]
            -> EMA after the update of iterations period, 2*period, ... (``AnchorConfig.due``)
            -> KL probe: captured after the first pi_old pass, scored after the EMA every probe_every
    -> checkpoint (our worker writes the anchor beside the actor) -> weight sync -> eval

The EMA runs inside ``_update_actor`` so that a checkpoint at step N contains the anchor update of step N,
and only on the last local update of a parameter-sync cycle. The pass instructions go in the batch's
``extra_info`` (non-tensor data for the workers); the Top-k tensors travel through TransferQueue.
"""

from __future__ import annotations

import time

import ray
import transfer_queue as tq
from omegaconf import open_dict
from transfer_queue import KVBatchMeta
from verl.single_controller.ray.base import RayResourcePool, ResourcePoolManager
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer

from experiments.backends.verl.config import TRAINER_MODE, EmaPGSection, topk_passes
from experiments.backends.verl.engine import CAP_KEY, DROP_KEY, set_pass
from experiments.backends.verl.evals import anchor_keys, append_rows, evals_path, problem_rows
from experiments.backends.verl.placement import trial_placement_group
from experiments.backends.verl.probe import pick
from experiments.backends.verl.worker import EmaPGActorRolloutRefWorker

EMA_TIMER, PROBE_TIMER = "emapg_ema", "emapg_probe"  # verl timers: timing_s/emapg_ema, timing_s/emapg_probe


def check_verl(config, section: EmaPGSection) -> None:
    """Fail before any GPU work on settings the plugin cannot run with."""
    arr = config.actor_rollout_ref
    problems = []
    if arr.actor.strategy != "fsdp2":
        problems.append(f"actor_rollout_ref.actor.strategy={arr.actor.strategy} (needs fsdp2)")
    if not arr.actor.use_kl_loss:
        problems.append(
            "actor_rollout_ref.actor.use_kl_loss=false (it must stay true: verl builds the reference only then)"
        )
    if arr.model.get("use_fused_kernels", False):
        problems.append("actor_rollout_ref.model.use_fused_kernels=true (fused kernels never materialise logits)")
    if arr.model.get("lora_rank", 0) > 0 or (arr.model.get("lora") or {}).get("rank", 0) > 0:
        problems.append("LoRA is on (the reference would be the adapter-free actor: nothing to average)")
    if arr.actor.get("ulysses_sequence_parallel_size", 1) != 1:
        problems.append("actor ulysses_sequence_parallel_size != 1 (Top-k under SP is not supported yet)")
    if arr.actor.fsdp_config.get("pad_to_length", False):
        problems.append("actor fsdp_config.pad_to_length=true")
    if arr.actor.fsdp_config.get("fsdp_size", -1) != arr.ref.fsdp_config.get("fsdp_size", -1):
        problems.append("actor and ref fsdp_config.fsdp_size differ (their shards must line up)")
    if config.trainer.v1.trainer_mode != TRAINER_MODE or not config.trainer.use_v1:
        problems.append(f"trainer.use_v1=true trainer.v1.trainer_mode={TRAINER_MODE} required")
    if problems:
        raise ValueError("verl settings incompatible with EMA-PG:\n  " + "\n  ".join(problems))


class TrialPoolManager(ResourcePoolManager):
    """verl's global worker pool as a sweep trial's placement group, rank r in bundle r. No availability check:
    the trial holds the GPUs already, so none of them are "available"."""

    def create_resource_pool(self):
        other = sorted(set(self.resource_pool_spec) - {"global_pool"})
        if other:
            raise ValueError(f"resource pools {other} are not supported inside a sweep trial (backend: verl)")
        pool = RayResourcePool(
            process_on_nodes=[sum(self.resource_pool_spec["global_pool"])],
            use_gpu=True,
            max_colocate_count=self.max_colocate_count,
            name_prefix="global_pool",
        )
        pool.pgs = [trial_placement_group()]  # get_placement_groups returns these
        self.resource_pool_dict["global_pool"] = pool


@register_trainer(TRAINER_MODE)
class EmaPGTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` with the EMA anchor and Top-k KL passes (see the module docstring)."""

    def __init__(self, config):
        self.emapg = EmaPGSection.from_config(config.emapg)
        check_verl(config, self.emapg)
        with open_dict(config):
            config.actor_rollout_ref.emapg = config.emapg  # workers receive actor_rollout_ref only
        super().__init__(config)
        self._passes = topk_passes(self.emapg.kl)
        self._evals = evals_path(self.emapg.metrics_path)
        self._eval_as, self._val_samples, self._val_rows = "policy", ([], []), []
        self._probe_ready = False  # the workers hold the KL probe (captured, or loaded with a checkpoint)

    @property
    def trainer_mode(self) -> str:
        """The mode verl sees: "sync". verl 0.9.1 takes its async paths (replay buffer, one-prompt fetches,
        TransferQueue in every checkpoint) for any ``trainer_mode != "sync"``, this trainer's registered name too."""
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:  # verl's __init__ assigns config.trainer.v1.trainer_mode
        if value != TRAINER_MODE:
            raise ValueError(f"trainer.v1.trainer_mode={value} (EmaPGTrainerSync runs as {TRAINER_MODE})")

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        if Role.ActorRolloutRef not in self.role_worker_mapping:
            raise ValueError("EMA-PG needs verl's actor_rollout_ref role (use_kl_loss=true, no LoRA, hybrid engine)")
        self.role_worker_mapping[Role.ActorRolloutRef] = ray.remote(EmaPGActorRolloutRefWorker)
        if trial_placement_group() is not None:  # in a sweep trial: the trial's group
            spec, mapping = self.resource_pool_manager.resource_pool_spec, self.resource_pool_manager.mapping
            self.resource_pool_manager = TrialPoolManager(resource_pool_spec=spec, mapping=mapping)

    def _compute_old_log_prob(self, batch, metrics):
        set_pass(batch.extra_info, **self._passes["old"])
        batch = super()._compute_old_log_prob(batch, metrics)
        if self.emapg.probe_every and not self._probe_ready:
            self._capture_probe(batch)
        return batch

    def _compute_ref_log_prob(self, batch, metrics):
        set_pass(batch.extra_info, **self._passes["ref"])
        return super()._compute_ref_log_prob(batch, metrics)

    def _update_actor(self, batch, metrics):
        set_pass(batch.extra_info, **self._passes["train"])
        cap = int(self.config.data.max_response_length) if self.emapg.mask_truncated else 0
        batch.extra_info.update({CAP_KEY: cap, DROP_KEY: cap > 0})
        if cap:  # from the response_len tag verl's agent loop gives every row (padding: 1); no TransferQueue get
            tags = batch.tags
            metrics["train/dropped_truncated"] = sum(t["response_len"] >= cap for t in tags) / max(len(tags), 1)
        try:
            batch = super()._update_actor(batch, metrics)
        finally:  # the update alone drops them: whatever reads this batch next sees every response
            batch.extra_info.update({CAP_KEY: 0, DROP_KEY: False})
        set_pass(batch.extra_info)  # off for whatever reads this batch next
        last_local = self.local_trigger_step == self.parameter_sync_step - 1
        if last_local and self.emapg.anchor.due(self.global_steps):
            with marked_timer(EMA_TIMER, self._timing_raw()):
                metrics.update(self.actor_rollout_wg.update_ref_ema(self.global_steps)[0])
        else:
            metrics["anchor/updated"] = 0.0
        every = self.emapg.probe_every
        if last_local and every and self.global_steps % every == 0:
            t0 = time.perf_counter()
            with marked_timer(PROBE_TIMER, self._timing_raw()):
                metrics.update(self.actor_rollout_wg.score_probe()[0])
            metrics["perf/probe_s"] = time.perf_counter() - t0
        return batch

    def _timing_raw(self) -> dict:
        """verl's timings of the current step (``fit`` sets ``timing_raw``); a throwaway dict outside ``fit``."""
        timing = getattr(self, "timing_raw", None)
        return timing if isinstance(timing, dict) else {}

    def _capture_probe(self, batch) -> None:
        """Hand the probe's rows (``pick``) to every worker rank, which keeps them with pi_probe."""
        uids = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid"])["uid"]
        rows = pick([str(u) for u in uids], batch.tags, self.emapg.probe_size)
        keys, tags = [batch.keys[i] for i in rows], [batch.tags[i] for i in rows]
        meta = KVBatchMeta(keys=keys, tags=tags, partition_id=batch.partition_id, fields=batch.fields)
        self.actor_rollout_wg.capture_probe(meta)
        self._probe_ready = True

    # ------------------------------------------------------------------ evaluation (experiments.backends.verl.evals)
    def _validate(self):
        """verl's validation of the policy, then of the EMA anchor; per-problem rows of both."""
        self._eval_as = "policy"
        metrics = super()._validate()
        if self.global_steps == 0:  # no update yet: the anchor is the policy
            append_rows(self._evals, [{**r, "model": "anchor"} for r in self._val_rows])
            return {**metrics, **anchor_keys(metrics)}
        return {**metrics, **self._validate_anchor()}

    def _validate_anchor(self) -> dict:
        """Validation with the anchor's weights in the rollout engine (verl's weight sync), then the actor's back."""
        self.checkpoint_manager.sleep_replicas()
        self.actor_rollout_wg.anchor_in_actor(True)
        try:
            self.checkpoint_manager.update_weights(self.global_steps)
            self._eval_as = "anchor"
            return anchor_keys(super()._validate())
        finally:
            self._eval_as = "policy"
            self.checkpoint_manager.sleep_replicas()
            self.actor_rollout_wg.anchor_in_actor(False)
            self.checkpoint_manager.update_weights(self.global_steps)

    def _maybe_log_val_generations(self, inputs, outputs, scores):
        self._val_samples = (list(inputs), list(scores))  # per sample, in the order of the uids verl passes next
        return super()._maybe_log_val_generations(inputs, outputs, scores)

    def _val_metrics_update(self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns, **kwargs):
        prompts, scores = self._val_samples
        greedy = not self.config.actor_rollout_ref.rollout.val_kwargs.do_sample
        rows = problem_rows(
            self.global_steps,
            self._eval_as,
            sources=data_sources,
            uids=sample_uids,
            prompts=prompts,
            scores=scores,
            greedy=greedy,
        )
        append_rows(self._evals, rows)
        self._val_rows = rows
        return super()._val_metrics_update(data_sources, sample_uids, reward_extra_infos_dict, sample_turns, **kwargs)
