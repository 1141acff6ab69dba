"""`make test-gpu` on a machine without CUDA, and which files it collects (tests/run_gpu.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import run_gpu

ROOT = Path(__file__).resolve().parents[1]


def test_it_collects_every_file_that_marks_a_test_gpu_and_no_other(tmp_path):
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests" / "a" / "test_x.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_x(): pass\n")
    (tmp_path / "tests" / "test_y.py").write_text("pytestmark = [pytest.mark.gpu, pytest.mark.slow]\n")
    (tmp_path / "tests" / "test_z.py").write_text("# gpu: a word, not a mark (pytest.mark.gpus)\n")
    (tmp_path / "tests" / "helper_gpu.py").write_text("pytest.mark.gpu\n")
    assert run_gpu.gpu_test_files(tmp_path) == ["tests/a/test_x.py", "tests/test_y.py"]
    assert "tests/core/test_cuda.py" in run_gpu.gpu_test_files()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("flags,code", [([], 1), (["--allow-skip"], 0)])
def test_without_cuda_it_says_so_in_one_line_and_exits_0_only_when_allowed(flags, code):
    out = subprocess.run([sys.executable, "tests/run_gpu.py", *flags], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == code, out.stderr
    assert out.stdout.startswith("no CUDA device: torch ") and out.stdout.count("\n") == 1 and not out.stderr
