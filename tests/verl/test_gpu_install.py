"""The GPU install (cluster/gpu-install.sh) is verl 0.9.1's `vllm` extra plus its `fsdp` extra without flash-attn,
read from the installed verl's metadata: a verl upgrade that changes either extra fails here."""

import importlib.metadata

import pytest
from packaging.requirements import Requirement

from cluster import gpu_install as G

pytestmark = pytest.mark.verl


def _extra(requires: list[str], name: str) -> list[Requirement]:
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": name}) and not req.marker.evaluate({"extra": ""}):
            req.marker = None
            out.append(req)
    return out


def test_the_install_is_verls_fsdp_extra_without_flash_attn():
    assert importlib.metadata.version("verl") == "0.9.1"
    requires = importlib.metadata.requires("verl")
    fsdp, vllm = _extra(requires, "fsdp"), _extra(requires, "vllm")
    flat = [r for r in fsdp if r.name != "verl"]
    for nested in (r for r in fsdp if r.name == "verl"):
        flat += [] if nested.extras == {"verl-core"} else [x for e in nested.extras for x in _extra(requires, e)]
    assert "flash-attn==2.8.3" in {str(r) for r in flat}  # what has no wheel for torch 2.11 + CUDA 13
    in_vllm = {str(r) for r in vllm}
    assert {"torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0"} <= in_vllm  # the same pins as fsdp's
    expected = {str(r) for r in flat if r.name != "flash-attn" and str(r) not in in_vllm}

    (args,) = G.pip_installs(G.readme_lines())
    ours = [Requirement(a) for a in G.without_lock(args) if a not in ("-e", ".[verl]")]
    assert {str(r) for r in ours if r.name != "verl"} == expected
    assert [str(r) for r in ours if r.name == "verl"] == ["verl[verl-core,vllm]==0.9.1"]
