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


@pytest.fixture()
def tq_local(tmp_path):
    """TransferQueue (SimpleStorage) on a local Ray bound to 127.0.0.1."""
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    import ray
    from omegaconf import OmegaConf

    tq = pytest.importorskip("transfer_queue")
    temp = f"/tmp/emapg_tq_{os.getpid()}"  # short: Ray's unix sockets live here
    ray.init(
        num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp, namespace="emapg_tq_test"
    )
    try:
        tq.init(
            OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 64}}})
        )
        yield tq
    finally:
        tq.close()
        ray.shutdown()
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", "ignore:.* engine is not available:UserWarning")
