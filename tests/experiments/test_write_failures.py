"""A write that fails mid-run (a full disk, a read-only directory) ends the run `failed` with one line naming the
path and the OS's reason; no partial checkpoint is left and the record stays consistent."""

from __future__ import annotations

import errno

import pytest
import torch

from experiments import records
from experiments.cli import main
from tests.experiments.small_run import one_point_spec, small_run

pytestmark = pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")


@pytest.fixture(autouse=True)
def env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path_factory.getbasetemp() / "write_cache"))
    monkeypatch.setenv("EMAPG_PROGRESS", "0")


def test_a_full_disk_during_a_checkpoint_fails_the_run_in_one_line_and_leaves_no_partial_checkpoint(
    tmp_path, capsys, monkeypatch
):
    real, saves = torch.save, []

    def full_at_the_second(obj, f, *args, **kwargs):  # the second checkpoint meets a full disk mid-write
        saves.append(1)
        if len(saves) == 2 and hasattr(f, "write"):  # a Python file: the OS's error, with its errno
            f.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        if len(saves) == 2:  # a path: torch's own writer, as measured on /dev/full
            with open(f, "wb") as out:
                out.write(b"PK\x03\x04 half a checkpoint")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_the_second)
    run = tmp_path / "run"
    args = small_run({"trainer.iterations": 4, "trainer.save_every": 1, "trainer.eval_every": 4})
    assert main(["train", *args, f"run_dir={run}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (
        f"emapg train: run failed: cannot write {run}/checkpoints/.tmp_iter_000002/state.pt: No space left on device"
    )
    assert records.read_status(run)[0] == "failed"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "latest"]  # no .tmp_iter_*
    assert [r["iteration"] for r in records.read_metrics(run)] == [0, 1, 2]  # recorded before the save failed
    assert main(["train", *args, f"run_dir={run}", "resume=true"]) == 0  # space back: it resumes from iteration 1
    assert records.read_status(run)[0] == "finished"
    assert [r["iteration"] for r in records.read_metrics(run)] == [0, 1, 2, 3, 4]


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A directory where nothing can be created (as on a read-only mount; root ignores chmod)."""
    import os

    ro, real = tmp_path / "ro", os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    return ro


def _one_line_exit_2(code, capsys, path):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].endswith(f"{path}: Read-only file system"), err
    return err


def test_a_read_only_run_dir_is_refused_in_one_line(read_only, capsys):
    code = main(["train", *small_run({"trainer.iterations": 1}), f"run_dir={read_only}/run"])
    assert len(_one_line_exit_2(code, capsys, read_only / "run")) == 1


def test_a_read_only_sweep_out_is_refused_in_one_line(read_only, tmp_path, capsys):
    spec = one_point_spec(tmp_path / "s.yaml")
    code = main(["sweep", str(spec), "--out", str(read_only / "out")])
    assert len(_one_line_exit_2(code, capsys, read_only / "out")) == 1


def test_a_read_only_report_out_is_refused(read_only, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *small_run({"trainer.iterations": 1}), f"run_dir={run}"]) == 0
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(read_only / "report")]) == 2  # one line, through errors.handle
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Read-only file system" in err[-1] and str(read_only / "report") in err[-1]


@pytest.mark.parametrize("name", ["plain", "with space", "it's [odd], {x}=y"])
def test_the_resume_line_printed_after_an_interrupt_parses_back_to_the_run_dir(tmp_path, name):
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.errors import RunInterrupted
    from experiments.run import resume_command

    run_dir = tmp_path / name
    line = resume_command(["experiment=math_tiny_grpo"], RunInterrupted("stopped", "SIGINT", run_dir))
    argv = shlex.split(line)
    assert argv[:3] == ["emapg", "train", "experiment=math_tiny_grpo"] and argv[-1] == "resume=true"
    (override,) = OverridesParser.create().parse_overrides([argv[3]])
    assert override.key_or_group == "run_dir" and override.value() == str(run_dir)
