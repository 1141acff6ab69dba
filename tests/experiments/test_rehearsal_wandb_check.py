"""The rehearsal's W&B check on a run directory built by hand: every offline run file that holds records names the
run's group; a file that holds only W&B's header (an attempt killed seconds after W&B started: seen in CI, where the
sweep rehearsal's driver kill cut one trial's retry) has no group to name and does not fail the check."""

import json

import yaml

from experiments.ops.rehearse import WANDB_HEADER, Expect, check_wandb

HEADER = b":W&B\xe1\xbe\x00"  # what W&B writes first (the 7 bytes of the file such a killed attempt left)


def _run_dir(tmp_path, bodies: list[bytes]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"experiment": "grp", "logger": {"name": "wandb"}}))
    (tmp_path / "wandb_run.json").write_text(json.dumps({"id": "abc12345", "mode": "offline"}))
    for i, body in enumerate(bodies):
        run = tmp_path / "wandb" / f"offline-run-2026112{i}_000000-abc12345"
        run.mkdir(parents=True)
        (run / "run-abc12345.wandb").write_bytes(HEADER + body)
    return tmp_path


def _expect() -> Expect:
    return Expect(steps=4, tau=0.9, period=2, topk=True, k=32, keep=2, killed_at=2, attempts=2)


def test_an_attempt_killed_before_its_first_record_does_not_fail_the_group_check(tmp_path):
    assert len(HEADER) == WANDB_HEADER
    check = check_wandb(_run_dir(tmp_path, [b"..grp..", b"", b"..grp.."]), _expect())
    assert check.ok, check.detail
    assert "named in each (1 killed before W&B wrote a record)" in check.detail


def test_a_record_without_the_group_and_a_run_with_no_record_at_all_fail(tmp_path):
    assert not check_wandb(_run_dir(tmp_path / "a", [b"..grp..", b"..other.."]), _expect()).ok
    assert not check_wandb(_run_dir(tmp_path / "b", [b"", b""]), _expect()).ok
