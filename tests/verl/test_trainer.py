"""The V1 trainer subclass's glue without GPUs: registration, the TaskRunner, the plugin's checks,
the Top-k flags per pass and the EMA schedule inside ``_update_actor`` (verl's own methods stubbed).
An end-to-end PPO step needs vLLM/SGLang and GPUs (not run here)."""

import pytest

pytestmark = pytest.mark.verl


def test_registered_and_runner(verl_cpu):
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.ppo.v1 import get_trainer_cls

    from experiments.backends.verl.main import EmaPGTaskRunner
    from experiments.backends.verl.trainer import EmaPGTrainerSync

    assert get_trainer_cls("emapg_sync") is EmaPGTrainerSync
    assert issubclass(EmaPGTaskRunner, TaskRunnerV1.__ray_actor_class__)


def test_verl_runs_the_trainer_as_sync(monkeypatch, verl_cpu):
    """verl's sync code paths, not its async modes' (which it picks for any trainer_mode but "sync"): the sync
    replay buffer, whole-batch dataloader fetches, and the prompts registered in TransferQueue without their data."""
    import torch
    from tensordict import TensorDict
    from verl.trainer.ppo.v1 import replay_buffer, trainer_base

    from experiments.backends.verl.main import compose
    from experiments.backends.verl.trainer import EmaPGTrainerSync

    cfg = compose(
        [
            "trainer.v1.trainer_mode=emapg_sync",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.rollout.name=vllm",
        ]
    )
    t = object.__new__(EmaPGTrainerSync)
    t.config, t.trainer_mode = cfg, cfg.trainer.v1.trainer_mode  # what verl's __init__ assigns
    assert t.trainer_mode == "sync"
    assert type(t._build_replay_buffer()) is replay_buffer.ReplayBuffer
    puts = []
    monkeypatch.setattr(trainer_base.tq, "kv_batch_put", lambda **kw: puts.append(kw))
    t.agent_loop_manager, t.global_steps = type("Loop", (), {"generate_sequences": lambda self, b: None})(), 1
    t._submit_batch_to_rollout(TensorDict({"uid": ["p0", "p1"], "input_ids": torch.ones(2, 3)}, batch_size=2))
    assert len(puts) == 1 and "fields" not in puts[0] and puts[0]["keys"] == ["p0", "p1"]
    with pytest.raises(ValueError, match="emapg_sync"):
        t.trainer_mode = "colocate_async"


class _WG:
    def __init__(self):
        self.calls = []

    def update_ref_ema(self, it):
        self.calls.append(it)
        return [{"anchor/updated": 1.0, "anchor/drift": 0.1}]


class _Meta:
    def __init__(self):
        self.extra_info = {}


def _trainer(monkeypatch, kl_type="topk_reverse", tau=0.9, period=3):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from ema_pg_core.config import AnchorConfig, KLConfig
    from experiments.backends.verl.config import EmaPGSection, topk_passes
    from experiments.backends.verl.trainer import EmaPGTrainerSync

    seen = {}

    def record(name):
        def stub(self, batch, metrics):
            seen[name] = dict(batch.extra_info)
            return batch

        return stub

    for name in ("_compute_old_log_prob", "_compute_ref_log_prob", "_update_actor"):
        monkeypatch.setattr(PPOTrainerSync, name, record(name))
    t = object.__new__(EmaPGTrainerSync)
    t.emapg = EmaPGSection(kl=KLConfig(type=kl_type, k=4), anchor=AnchorConfig(tau=tau, period=period))
    t._passes = topk_passes(t.emapg.kl)
    t.actor_rollout_wg, t.local_trigger_step, t.parameter_sync_step = _WG(), 0, 1
    return t, seen


def test_flags_per_pass_and_ema_schedule(monkeypatch, verl_cpu):
    from experiments.backends.verl.engine import IDS_KEY, LOGP, MODE

    t, seen = _trainer(monkeypatch)
    updated = []
    for it in range(1, 8):
        t.global_steps = it
        b, m = _Meta(), {}
        t._compute_old_log_prob(b, m)
        t._compute_ref_log_prob(b, m)
        t._update_actor(b, m)
        updated.append(m["anchor/updated"])
        assert b.extra_info[MODE] == "off"  # reset after the update
    assert seen["_compute_old_log_prob"][MODE] == "ids"
    assert (
        seen["_compute_ref_log_prob"][MODE] == "gather"
        and seen["_compute_ref_log_prob"][IDS_KEY] == "emapg_old_topk_ids"
        and seen["_compute_ref_log_prob"][LOGP] is True
    )
    assert seen["_update_actor"][MODE] == "train" and seen["_update_actor"][LOGP] is False
    assert t.actor_rollout_wg.calls == [3, 6] and updated == [0, 0, 1, 0, 0, 1, 0]


def test_ema_and_probe_are_timed_in_verls_timings(monkeypatch, verl_cpu):
    """The EMA and KL probe RPCs land in verl's timing_raw (logged as timing_s/emapg_ema, timing_s/emapg_probe)
    at the steps that run them, and nowhere else."""
    from experiments.backends.verl.trainer import EMA_TIMER, PROBE_TIMER

    t, _ = _trainer(monkeypatch, kl_type="k3", tau=0.9, period=2)
    t.emapg.probe_every = 3
    t.actor_rollout_wg.score_probe = lambda: [{"kl/exact": 0.0}]
    timers = {}
    for it in range(1, 7):
        t.global_steps, t.timing_raw = it, {}
        t._update_actor(_Meta(), {})
        timers[it] = sorted(t.timing_raw)
    assert timers == {
        1: [],
        2: [EMA_TIMER],
        3: [PROBE_TIMER],
        4: [EMA_TIMER],
        5: [],
        6: [EMA_TIMER, PROBE_TIMER],
    }
    del t.timing_raw  # outside verl's fit (no timing_raw): the RPCs run untimed
    t._update_actor(_Meta(), {})


def test_fixed_anchor_never_updates(monkeypatch, verl_cpu):
    t, _ = _trainer(monkeypatch, kl_type="k3", tau=1.0, period=1)
    for it in range(1, 5):
        t.global_steps = it
        t._update_actor(_Meta(), {})
    assert t.actor_rollout_wg.calls == []


@pytest.mark.parametrize(
    "override,match",
    [
        ("actor_rollout_ref.actor.strategy=fsdp", "fsdp2"),
        ("actor_rollout_ref.model.use_fused_kernels=true", "fused"),
        ("actor_rollout_ref.model.lora_rank=8", "LoRA"),
        ("actor_rollout_ref.actor.use_kl_loss=false", "use_kl_loss"),
        ("trainer.v1.trainer_mode=sync", "emapg_sync"),
    ],
)
def test_check_verl_refuses_incompatible_settings(override, match, verl_cpu):
    from experiments.backends.verl.main import compose

    base = [
        "trainer.v1.trainer_mode=emapg_sync",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.name=vllm",
    ]
    with pytest.raises(ValueError, match=match):
        compose(base + [override])


# ---------------------------------------------------------------- mask_truncated (the 8k math stage)
def _jagged(rows):
    import torch

    return torch.nested.nested_tensor_from_jagged(torch.cat(rows), offsets=torch.tensor([0, *map(len, rows)]).cumsum(0))


def test_drop_truncated_zeroes_the_rows_that_hit_the_cap(verl_cpu):
    import torch

    from experiments.backends.verl.engine import drop_truncated

    rows = [torch.tensor([1, 1, 1]), torch.tensor([1, 1, 0, 0, 1]), torch.tensor([1, 1, 1, 1, 1]), torch.tensor([1, 0])]
    mask = _jagged(rows)  # row 1: a multi-turn response with 2 information tokens
    masked, truncated = drop_truncated(mask, torch.tensor([3, 5, 5, 2]), cap=5)
    assert truncated.tolist() == [False, True, True, False]
    assert torch.equal(masked.offsets(), mask.offsets())
    assert [r.tolist() for r in masked.unbind()] == [[1, 1, 1], [0] * 5, [0] * 5, [1, 0]]
    assert torch.equal(drop_truncated(mask, torch.tensor([3, 5, 5, 2]), cap=6)[0].values(), mask.values())
    dense = torch.stack([torch.cat([r, r.new_zeros(5 - len(r))]) for r in rows])  # (4, 5): the rows, right-padded
    assert drop_truncated(dense, torch.tensor([3, 5, 5, 2]), cap=5)[0].tolist() == [
        [1, 1, 1, 0, 0],
        [0] * 5,
        [0] * 5,
        [1, 0, 0, 0, 0],
    ]


def test_a_zero_mask_drops_a_response_from_verls_loss_aggregation(verl_cpu):
    """verl's agg_loss alone: token-mean is identical to leaving the response out of the batch;
    seq-mean-token-mean divides by global_batch_size, so it drops the response only when that is the
    kept count (what the engine's DROP_KEY sets; tests/verl/test_loss.py), not the mini-batch size."""
    import torch
    from verl.trainer.ppo.core_algos import agg_loss

    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 7, generator=gen, dtype=torch.float64)  # (B, T)
    lengths = torch.tensor([7, 3, 7, 5, 1, 7])
    mask = (torch.arange(7) < lengths[:, None]).double()  # (B, T)
    keep = lengths < 7  # rows 0, 2, 5 hit the cap of 7
    zeroed = mask * keep[:, None]
    kept = agg_loss(loss[keep], mask[keep], "token-mean")
    assert torch.allclose(agg_loss(loss, zeroed, "token-mean"), kept, rtol=1e-12)
    kept = agg_loss(loss[keep], mask[keep], "seq-mean-token-mean", global_batch_size=int(keep.sum()))
    masked = agg_loss(loss, zeroed, "seq-mean-token-mean", global_batch_size=6)
    assert torch.allclose(masked, kept * keep.sum() / 6, rtol=1e-12)


def test_update_actor_sends_the_cap_and_moves_nothing_through_transfer_queue(monkeypatch, verl_cpu, tq_local):
    """Through a real TransferQueue: the trainer neither fetches nor puts anything for mask_truncated; the update
    receives the length cap (the engine masks the capped responses for the update alone: tests/verl/test_loss.py)
    and the drop flag; the share dropped comes from verl's tags; TransferQueue keeps the full mask throughout."""
    import torch
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from experiments.backends.verl.engine import CAP_KEY, DROP_KEY

    tq, keys = tq_local, ["a", "b", "c", "d"]
    lengths = [3, 5, 2, 5]
    responses = _jagged([torch.arange(n) for n in lengths])
    mask = _jagged([torch.ones(n, dtype=torch.int64) for n in lengths])
    tq.kv_batch_put(
        keys=keys,
        partition_id="train",
        fields=TensorDict({"responses": responses, "response_mask": mask}, batch_size=4),
    )
    traffic, seen = [], {}
    for name in ("kv_batch_put", "kv_batch_get", "kv_put", "kv_get", "async_kv_batch_put", "async_kv_batch_get"):
        if hasattr(tq, name):
            monkeypatch.setattr(tq, name, lambda *a, _name=name, **k: traffic.append(_name))

    def update(self, batch, metrics):
        seen.update(cap=batch.extra_info[CAP_KEY], drop=batch.extra_info[DROP_KEY])
        return batch

    t, _ = _trainer(monkeypatch)
    monkeypatch.setattr(PPOTrainerSync, "_update_actor", update)
    t.emapg.mask_truncated, t.global_steps = True, 1
    t.config = OmegaConf.create({"data": {"max_response_length": 5}})
    batch, metrics = _Meta(), {}
    batch.keys, batch.partition_id = keys, "train"
    batch.tags = [{"response_len": n} for n in lengths]  # what verl's agent loop tags every row with
    t._update_actor(batch, metrics)
    assert traffic == [] and seen == {"cap": 5, "drop": True}
    assert metrics["train/dropped_truncated"] == 0.5
    assert batch.extra_info[CAP_KEY] == 0 and batch.extra_info[DROP_KEY] is False
    monkeypatch.undo()
    after = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["response_mask"])["response_mask"]
    assert [r.tolist() for r in after.unbind()] == [[1] * n for n in lengths]


def test_mask_truncated_off_leaves_the_batch_alone(monkeypatch, verl_cpu):
    t, seen = _trainer(monkeypatch)
    t.global_steps, m = 1, {}
    t._update_actor(_Meta(), m)  # no keys, no TransferQueue: it is never touched
    from experiments.backends.verl.engine import CAP_KEY, DROP_KEY

    assert "train/dropped_truncated" not in m and seen["_update_actor"][DROP_KEY] is False
    assert seen["_update_actor"][CAP_KEY] == 0
