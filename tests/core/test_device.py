"""trainer.device: syntax in TrainerConfig, availability in resolve_device, where the local trainer's tensors live."""

from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ema_pg_core.config import TrainerConfig
from ema_pg_core.local import trainer as trainer_module
from ema_pg_core.local.device import resolve_device
from ema_pg_core.local.tiny import build_model
from ema_pg_core.local.trainer import LocalTrainer
from tests.core.test_local import TOK, Toy, make_cfg, train


def on_device(cfg, device: str, fp32_shadow: bool = False):
    """cfg with trainer.device (and algo.anchor.fp32_shadow) set."""
    algo = replace(cfg.algo, anchor=replace(cfg.algo.anchor, fp32_shadow=fp32_shadow))
    return replace(cfg, algo=algo, trainer=replace(cfg.trainer, device=device))


# ------------------------------------------------------------------ config syntax (no availability check)
@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:3", "auto"])
def test_trainer_config_accepts_the_local_devices_without_checking_the_machine(device):
    assert TrainerConfig(device=device).device == device


@pytest.mark.parametrize("device", ["tpu9", "cuda:x", "cuda:", "CUDA", "gpu", "mps", "", "cuda:0 "])
def test_trainer_config_rejects_other_devices_in_one_line(device):
    msg = r"^trainer\.device=.* is not allowed; allowed values: cpu, cuda, cuda:N, auto$"
    with pytest.raises(ValueError, match=msg):
        TrainerConfig(device=device)


# ------------------------------------------------------------------ resolve_device
def test_resolve_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(
            ValueError,
            match=rf"^trainer\.device='{name}' but CUDA is not available on this machine; "
            r"allowed here: cpu, auto$",
        ):
            resolve_device(name)
    with pytest.raises(ValueError, match=r"trainer\.device='tpu9' is not allowed"):
        resolve_device("tpu9")


def test_resolve_device_with_cuda_checks_the_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)  # an explicit index: comparable to tensor.device
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    msg = r"^trainer\.device='cuda:2' but this machine has 2 CUDA device\(s\): cuda:0 \.\. cuda:1$"
    with pytest.raises(ValueError, match=msg):
        resolve_device("cuda:2")


def test_auto_is_cpu_on_this_machine():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert resolve_device("auto") == torch.device("cpu")


def test_trainer_refuses_cuda_without_cuda_before_touching_the_model(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    policy = build_model(TOK, hidden=16, layers=1, heads=2, seed=0)
    with pytest.raises(ValueError, match=r"trainer\.device='cuda' but CUDA is not available"):
        LocalTrainer(policy, TOK, Toy(), on_device(make_cfg(), "cuda"), tmp_path)
    assert {p.device.type for p in policy.parameters()} == {"cpu"}


# ------------------------------------------------------------------ where the tensors live
def _tensors(x):
    """Tensors and generators anywhere in nested args/kwargs/results."""
    if isinstance(x, (torch.Tensor, torch.Generator)):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class DeviceRecorder(TorchFunctionMode):
    """Records the device of every tensor (and generator) argument and result of every torch function call."""

    def __init__(self):
        super().__init__()
        self.devices: dict[torch.device, int] = {}
        self.calls: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in _tensors((args, kwargs, out)):
            self.devices[t.device] = self.devices.get(t.device, 0) + 1
        if any(isinstance(g, torch.Generator) for g in _tensors((args, kwargs))):
            self.calls.add(getattr(func, "__name__", str(func)))
        return out


def test_device_recorder_catches_a_tensor_on_another_device():
    with DeviceRecorder() as rec:
        torch.ones(3) + 1
        torch.zeros(2, device="meta") * 2
    assert set(rec.devices) == {torch.device("cpu"), torch.device("meta")}


@pytest.mark.parametrize("kl,shadow", [("topk_reverse", False), ("exact_reverse", True)])
def test_every_tensor_of_an_iteration_and_an_evaluation_lives_on_the_configured_device(tmp_path, kl, shadow):
    cfg = on_device(make_cfg(kl, iterations=1), "cpu", fp32_shadow=shadow)
    tr = LocalTrainer(build_model(TOK, hidden=32, layers=1, heads=2, seed=0), TOK, Toy(), cfg, tmp_path)
    with DeviceRecorder() as rec:
        metrics = tr.step()  # rollout, rewards, advantages, collate, reference stats, PPO updates, anchor EMA
        tr.evaluate()  # policy and anchor, greedy and sampled
        tr.resume(tr.save())
    assert metrics["anchor/updated"] == 1.0  # the EMA ran inside the recorder
    assert sum(rec.devices.values()) > 10_000  # it saw the work, not an empty trace
    assert {"multinomial", "randperm"} <= rec.calls  # sampling and mini-batch order with the trainer's generator
    assert set(rec.devices) == {tr.device} == {torch.device("cpu")}
    state = [
        *tr.policy.state_dict().values(),
        *tr.anchor.module.state_dict().values(),
        *(tr.anchor.shadow or []),
        *(v for s in tr.opt.state.values() for v in s.values()),
    ]
    assert {t.device for t in state} == {torch.device("cpu")} and tr.gen.device == tr.device


def test_a_checkpoint_from_another_device_type_is_refused(tmp_path):
    tr = LocalTrainer(build_model(TOK, hidden=16, layers=1, heads=2, seed=0), TOK, Toy(), make_cfg(), tmp_path)
    path = tr.save()
    state = torch.load(path / "state.pt", weights_only=False)
    assert state["rng"]["device"] == "cpu" and "cuda" not in state["rng"]
    state["rng"]["device"] = "cuda"
    torch.save(state, path / "state.pt")
    with pytest.raises(ValueError, match=r"written with trainer\.device=cuda; .* resume with trainer\.device=cuda$"):
        tr.resume(path)


# ------------------------------------------------------------------ CUDA (not run on the CPU-only development machine)
@pytest.mark.gpu
def test_cuda_iteration_places_everything_on_cuda_and_resumes_exactly(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read when CUDA starts)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # gather/index_add backward use atomics otherwise
    batches = []
    collate = trainer_module.collate
    monkeypatch.setattr(trainer_module, "collate", lambda *a, **k: batches.append(collate(*a, **k)) or batches[-1])
    try:
        cfg = on_device(make_cfg(), "cuda", fp32_shadow=True)
        tr, full = train(cfg, tmp_path / "a")
        cuda = resolve_device("cuda")
        assert tr.device == cuda and tr.gen.device == cuda
        assert {p.device for p in tr.policy.parameters()} == {cuda}
        assert {p.device for p in tr.anchor.module.parameters()} == {cuda}
        assert {t.device for t in tr.anchor.shadow} == {cuda}
        assert {t.device for s in tr.opt.state.values() for k, t in s.items() if k != "step"} == {cuda}
        assert batches and all(t.device == cuda for b in batches for t in vars(b).values())
        _, part1 = train(cfg, tmp_path / "b", stop_after=2)
        _, part2 = train(cfg, tmp_path / "b", resume_from=LocalTrainer.latest_checkpoint(tmp_path / "b"))
        assert {**part1, **part2} == full
    finally:
        torch.use_deterministic_algorithms(was)
