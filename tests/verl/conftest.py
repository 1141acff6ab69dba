"""tests/verl: helper modules here (cpu_shim, workers for spawned processes) import by plain name,
so that torch.multiprocessing.spawn children can unpickle functions defined in them."""

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="session")
def verl_cpu():
    """verl on CPU: the test platform shim and a gloo process group of size 1 (for this session)."""
    pytest.importorskip("verl")
    import cpu_shim

    cpu_shim.install()
    cpu_shim.init_gloo()
    import torch

    torch.set_num_threads(2)
    return True


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory, verl_cpu):
    import engines

    return engines.save_tiny(tmp_path_factory.mktemp("tiny") / "model")


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", "ignore:.* engine is not available:UserWarning")
