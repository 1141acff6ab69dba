"""The V1 trainer subclass's glue without GPUs: registration, the TaskRunner, the plugin's checks,
the Top-k flags per pass and the EMA schedule inside ``_update_actor`` (verl's own methods stubbed).
An end-to-end PPO step needs vLLM/SGLang and GPUs (not run here)."""

import pytest

pytestmark = pytest.mark.verl


def test_registered_and_runner(verl_cpu):
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.ppo.v1 import get_trainer_cls

    from ema_pg_core.verl.main import EmaPGTaskRunner
    from ema_pg_core.verl.trainer import EmaPGTrainerSync

    assert get_trainer_cls("emapg_sync") is EmaPGTrainerSync
    assert issubclass(EmaPGTaskRunner, TaskRunnerV1.__ray_actor_class__)


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
    from ema_pg_core.verl.config import EmaPGSection, topk_passes
    from ema_pg_core.verl.trainer import EmaPGTrainerSync

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
    from ema_pg_core.verl.engine import IDS_KEY, MODE

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
    assert seen["_compute_old_log_prob"][MODE] == "self"
    assert seen["_compute_ref_log_prob"][MODE] == "gather" and seen["_compute_ref_log_prob"][IDS_KEY] == "emapg_old_topk_ids"
    assert seen["_update_actor"][MODE] == "train"
    assert t.actor_rollout_wg.calls == [3, 6] and updated == [0, 0, 1, 0, 0, 1, 0]


def test_fixed_anchor_never_updates(monkeypatch, verl_cpu):
    t, _ = _trainer(monkeypatch, kl_type="k3", tau=1.0, period=1)
    for it in range(1, 5):
        t.global_steps = it
        t._update_actor(_Meta(), {})
    assert t.actor_rollout_wg.calls == []


@pytest.mark.parametrize("override,match", [
    ("actor_rollout_ref.actor.strategy=fsdp", "fsdp2"),
    ("actor_rollout_ref.model.use_fused_kernels=true", "fused"),
    ("actor_rollout_ref.model.lora_rank=8", "LoRA"),
    ("actor_rollout_ref.actor.use_kl_loss=false", "use_kl_loss"),
    ("trainer.v1.trainer_mode=sync", "emapg_sync"),
])
def test_check_verl_refuses_incompatible_settings(override, match, verl_cpu):
    from ema_pg_core.verl.main import compose

    base = ["trainer.v1.trainer_mode=emapg_sync", "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.rollout.name=vllm"]
    with pytest.raises(ValueError, match=match):
        compose(base + [override])
