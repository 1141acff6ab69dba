"""The worker subclass's methods on real CPU engines (the worker built outside Ray:
``init_model`` itself builds a vLLM rollout and needs GPUs):

- ``update_ref_ema`` mixes the reference (anchor) towards the actor exactly like ``ema_update_``;
- ``save_checkpoint`` -> ``load_checkpoint`` round-trips the policy and the anchor (and the
  update count), with the anchor beside the actor in ``global_step_N/anchor``;
- a missing anchor on resume is an error; with tau = 1 no anchor is saved or required;
- ``max_ckpt_to_keep`` prunes whole ``global_step_N`` directories (actor, anchor, data.pt) from
  what is on disk, so checkpoints written before a resume go too: the pure decision over a table
  of cases, checked against verl's own in-process pruning, and through the worker's methods.
"""

import os

import engines
import pytest
import torch

pytestmark = pytest.mark.verl


def _full(module):
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }


def _worker(tiny_path, tau=0.9):
    from ema_pg_core.config import AnchorConfig
    from experiments.backends.verl.config import EmaPGSection

    return engines.emapg_worker(tiny_path, EmaPGSection(anchor=AnchorConfig(tau=tau, period=10)))


_perturb = engines.perturb


def test_setup_installs_engine_and_loss(tiny_path):
    from experiments.backends.verl.engine import EmaPGFSDPEngineWithLMHead
    from experiments.backends.verl.loss import emapg_actor_loss

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
    from experiments.backends.verl.worker import ANCHOR_META

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
    from experiments.backends.verl.config import EmaPGSection

    with pytest.raises(ValueError, match="fp32"):
        w.emapg_setup(EmaPGSection(anchor=AnchorConfig(tau=0.9)))


def _trainer_save(w, root, step, keep):
    """What verl's trainer does per save: the worker writes ``actor`` (+ ``anchor``), then the trainer
    adds the dataloader state and, last, points the tracker file at this step."""
    step_dir = root / f"global_step_{step}"
    w.save_checkpoint(str(step_dir / "actor"), None, step, max_ckpt_to_keep=keep)
    torch.save({"step": step}, step_dir / "data.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


def _steps_on_disk(root):
    return sorted(int(p.name.split("_")[-1]) for p in root.iterdir() if p.name.startswith("global_step_"))


def _assert_complete(root, steps):
    from experiments.backends.verl.worker import ANCHOR_META

    for s in steps:
        d = root / f"global_step_{s}"
        assert (d / "actor").is_dir() and (d / "anchor" / ANCHOR_META).is_file() and (d / "data.pt").is_file(), d


def test_retention_keeps_newest_steps_across_a_resume(tiny_path, tmp_path):
    w = _worker(tiny_path, tau=0.9)
    for step in (1, 2, 3, 4):
        w.update_ref_ema(step)
        _trainer_save(w, tmp_path, step, keep=2)
    assert _steps_on_disk(tmp_path) == [3, 4]
    _assert_complete(tmp_path, [3, 4])

    w2 = _worker(tiny_path, tau=0.9)  # a restarted process: verl's in-memory list of saved paths is empty
    w2.load_checkpoint(str(tmp_path / "global_step_4" / "actor"), None, False)
    for step in (5, 6):
        w2.update_ref_ema(step)
        _trainer_save(w2, tmp_path, step, keep=2)
    assert _steps_on_disk(tmp_path) == [5, 6]
    _assert_complete(tmp_path, [5, 6])
    w3 = _worker(tiny_path, tau=0.9)
    w3.load_checkpoint(str(tmp_path / "global_step_6" / "actor"), None, False)
    assert w3._anchor_updates == 6


def _names(*steps):
    return [f"global_step_{s}" for s in steps]


RETENTION_CASES = [
    # (steps on disk, current, keep, tracker step, steps to remove)
    ((1, 2, 3, 4), 4, 2, 3, (1, 2)),
    ((1, 2, 3, 4), 4, None, 3, ()),  # no limit
    ((1, 2, 3, 4), 4, 0, 3, ()),  # verl: 0 and negatives mean no limit too
    ((1, 2, 3, 4), 4, -1, 3, ()),
    ((1, 2, 3, 4), 4, 9, 3, ()),  # fewer on disk than allowed
    ((1, 2, 3, 4), 4, 1, 3, (1, 2)),  # the tracker's step survives until the next save
    ((1, 2, 3, 4), 4, 1, None, (1, 2, 3)),  # no tracker yet (or unreadable)
    ((1, 2, 3, 4), 4, 2, 1, (2,)),  # a tracker left behind (crash before it moved) is spared
    ((1, 2, 3, 4), 4, 1, 4, (1, 2, 3)),
    ((1, 2, 3), 4, 2, 3, (1, 2)),  # the current step counts even if not listed
    ((1, 2, 3, 5, 6, 8), 3, 2, 8, (1,)),  # steps after the current one are left alone
    ((9, 10, 11), 11, 2, 10, (9,)),  # numeric order, not string order
    ((11, 9, 10, 2), 11, 2, None, (2, 9)),  # input order does not matter
]


@pytest.mark.parametrize("on_disk, current, keep, tracked, removed", RETENTION_CASES)
def test_step_dirs_to_remove(on_disk, current, keep, tracked, removed):
    from experiments.backends.verl.worker import step_dirs_to_remove

    assert step_dirs_to_remove(_names(*on_disk), current, keep, tracked) == _names(*removed)


def test_step_dirs_to_remove_ignores_other_names():
    from experiments.backends.verl.worker import step_dirs_to_remove

    others = [
        "latest_checkpointed_iteration.txt",
        "global_step_03",
        "global_step_x",
        "global_step_2.tmp",
        "global_step_",
        "notes",
        "global_step_-1",
    ]
    assert step_dirs_to_remove(others + _names(1, 2, 3), 3, 1, 2) == _names(1)


def test_step_layout_parses_the_trainer_layout():
    from experiments.backends.verl.worker import step_layout

    assert step_layout("/r/ckpt/global_step_7/actor") == ("/r/ckpt", 7)
    assert step_layout("/r/ckpt/global_step_7/actor/") == ("/r/ckpt", 7)
    assert step_layout("/r/ckpt/step_7/actor") is None
    assert step_layout("/r/ckpt/global_step_7") is None  # the step dir itself is not an actor path


@pytest.mark.parametrize("keep", [None, 0, -2, 2, 3, 5])
def test_retention_matches_verl_within_one_process(keep):
    """Without a restart, verl's in-memory pruning and ours end with the same steps (keep != 1)."""
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    from experiments.backends.verl.worker import step_dirs_to_remove

    mgr = object.__new__(BaseCheckpointManager)  # only the retention bookkeeping is used
    mgr.previous_saved_paths, removed_by_verl = [], []
    mgr.remove_previous_save_local_path = removed_by_verl.extend
    on_disk = set()
    for step in range(1, 8):
        mgr.ensure_checkpoint_capacity(keep)
        mgr.register_checkpoint(f"global_step_{step}", keep)
        on_disk.add(f"global_step_{step}")
        on_disk -= set(step_dirs_to_remove(on_disk, step, keep, step - 1 if step > 1 else None))
    assert on_disk == {f"global_step_{s}" for s in range(1, 8)} - set(removed_by_verl)


def test_remove_old_step_dirs_is_safe_to_repeat(tmp_path):
    from experiments.backends.verl.worker import remove_old_step_dirs

    for s in (1, 2, 3, 4):
        (tmp_path / f"global_step_{s}" / "actor").mkdir(parents=True)
    (tmp_path / "global_step_5").write_text("a file, not a checkpoint")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")
    assert remove_old_step_dirs(str(tmp_path), 4, 2) == _names(1, 2)
    assert remove_old_step_dirs(str(tmp_path), 4, 2) == []  # nothing left to do, and no error
    assert remove_old_step_dirs(str(tmp_path), 4, 1) == []  # 3 is the tracker's
    assert sorted(p.name for p in tmp_path.iterdir()) == _names(3, 4, 5) + ["latest_checkpointed_iteration.txt"]


def test_retention_with_a_fixed_anchor_and_keep_one(tiny_path, tmp_path):
    """tau = 1 saves no anchor but the step directories are still pruned; keep = 1 spares the tracker's."""
    w = _worker(tiny_path, tau=1.0)
    for step in (1, 2, 3):
        _trainer_save(w, tmp_path, step, keep=1)
    assert _steps_on_disk(tmp_path) == [2, 3]
    assert (tmp_path / "global_step_2" / "actor").is_dir() and (tmp_path / "global_step_3" / "actor").is_dir()
    assert not (tmp_path / "global_step_3" / "anchor").exists()
