"""The worker subclass's methods on real CPU engines (the worker built outside Ray, as
verl-0.9.md §3.6 suggests; ``init_model`` itself builds a vLLM rollout and needs GPUs):

- ``update_ref_ema`` mixes the reference (anchor) towards the actor exactly like ``ema_update_``;
- ``save_checkpoint`` -> ``load_checkpoint`` round-trips the policy and the anchor (and the
  update count), with the anchor beside the actor in ``global_step_N/anchor``;
- a missing anchor on resume is an error; with tau = 1 no anchor is saved or required.
"""

import os
from functools import partial

import pytest
import torch

import engines

pytestmark = pytest.mark.verl


def _full(module):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()}


def _worker(tiny_path, tau=0.9):
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    from ema_pg_core.config import AnchorConfig
    from ema_pg_core.verl.config import EmaPGSection
    from ema_pg_core.verl.worker import EmaPGActorRolloutRefWorker

    w = object.__new__(EmaPGActorRolloutRefWorker)  # the RPC methods need only these attributes
    w.role, w.distillation_enabled = "actor_rollout_ref", False
    w.actor = engines.training_worker(tiny_path, forward_only=False)
    w.ref = engines.training_worker(tiny_path, forward_only=True)
    w.loss_fn = partial(ppo_loss, config=FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=4,
                                                         ppo_micro_batch_size_per_gpu=4, rollout_n=1))
    w.actor.set_loss_fn(w.loss_fn)
    w.emapg_setup(EmaPGSection(anchor=AnchorConfig(tau=tau, period=10)))
    return w


def _perturb(module, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            loc = p.to_local()
            loc.add_(scale * torch.randn(loc.shape, generator=g))


def test_setup_installs_engine_and_loss(tiny_path):
    from ema_pg_core.verl.engine import EmaPGFSDPEngineWithLMHead
    from ema_pg_core.verl.loss import emapg_actor_loss

    w = _worker(tiny_path)
    assert type(w.actor.engine) is EmaPGFSDPEngineWithLMHead and type(w.ref.engine) is EmaPGFSDPEngineWithLMHead
    assert w.actor.loss_fn.func is emapg_actor_loss


def test_update_ref_ema_matches_core(tiny_path):
    from ema_pg_core.anchor import ema_update_

    w = _worker(tiny_path, tau=0.9)
    _perturb(w.actor.engine.module, 0.1, seed=1)
    actor, anchor = _full(w.actor.engine.module), _full(w.ref.engine.module)
    names = sorted(anchor)
    ema_update_([anchor[n] for n in names], [actor[n] for n in names], 0.9)
    m = w.update_ref_ema(10)
    got = _full(w.ref.engine.module)
    for n in names:
        torch.testing.assert_close(got[n], anchor[n], atol=1e-7, rtol=0)
    assert m["anchor/updated"] == 1.0 and m["anchor/num_updates"] == 1.0 and m["anchor/last_iteration"] == 10
    diff = torch.sqrt(sum(((actor[n] - got[n]) ** 2).sum() for n in names)).item()
    assert m["anchor/dist"] == pytest.approx(diff, rel=1e-4)


def test_save_load_round_trips_policy_and_anchor(tiny_path, tmp_path):
    from ema_pg_core.verl.worker import ANCHOR_META

    w = _worker(tiny_path, tau=0.9)
    _perturb(w.actor.engine.module, 0.1, seed=2)
    w.update_ref_ema(10)
    w.update_ref_ema(20)
    saved_actor, saved_anchor = _full(w.actor.engine.module), _full(w.ref.engine.module)
    actor_dir = str(tmp_path / "global_step_20" / "actor")
    w.save_checkpoint(actor_dir, None, 20, None)
    assert os.path.isfile(tmp_path / "global_step_20" / "anchor" / ANCHOR_META)

    w2 = _worker(tiny_path, tau=0.9)  # a fresh process: initial policy and anchor
    assert any(not torch.equal(saved_anchor[n], v) for n, v in _full(w2.ref.engine.module).items())
    w2.load_checkpoint(actor_dir, None, False)
    for got, want in ((_full(w2.actor.engine.module), saved_actor), (_full(w2.ref.engine.module), saved_anchor)):
        for n in want:
            assert torch.equal(got[n], want[n]), n
    assert w2._anchor_updates == 2
    assert w2.update_ref_ema(30)["anchor/num_updates"] == 3.0


def test_missing_anchor_on_resume_is_an_error(tiny_path, tmp_path):
    import shutil

    w = _worker(tiny_path, tau=0.9)
    actor_dir = str(tmp_path / "global_step_10" / "actor")
    w.save_checkpoint(actor_dir, None, 10, None)
    shutil.rmtree(tmp_path / "global_step_10" / "anchor")
    with pytest.raises(FileNotFoundError, match="Refusing to restart the anchor"):
        _worker(tiny_path, tau=0.9).load_checkpoint(actor_dir, None, False)


def test_fixed_anchor_saves_and_needs_no_anchor(tiny_path, tmp_path):
    w = _worker(tiny_path, tau=1.0)
    actor_dir = str(tmp_path / "global_step_10" / "actor")
    w.save_checkpoint(actor_dir, None, 10, None)
    assert not (tmp_path / "global_step_10" / "anchor").exists()
    _worker(tiny_path, tau=1.0).load_checkpoint(actor_dir, None, False)


def test_low_precision_anchor_is_refused(tiny_path):
    w = _worker(tiny_path, tau=1.0)
    object.__setattr__(w.ref.engine_config, "model_dtype", "bf16")  # verl's configs are frozen
    from ema_pg_core.config import AnchorConfig
    from ema_pg_core.verl.config import EmaPGSection

    with pytest.raises(ValueError, match="fp32"):
        w.emapg_setup(EmaPGSection(anchor=AnchorConfig(tau=0.9)))
