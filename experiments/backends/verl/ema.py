"""EMA of the anchor from the policy on FSDP2 local shards: theta_ema <- tau*theta_ema + (1-tau)*theta.

When the anchor (verl's reference) and the policy (verl's actor) are sharded alike (same mesh and placements:
verl builds both with ``create_device_mesh(world_size, fsdp_size)``), their local shards hold the same
elements, so the EMA is ``ema_pg_core.anchor.ema_update_`` on the local shards, with no communication. Every
floating parameter and buffer is mixed, as ``EmaAnchor`` does. ``drift`` gives the ``anchor/*`` metrics from
per-rank sums of squares (each element counted once), then one all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ema_pg_core.anchor import ema_update_


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def floating_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Named floating parameters then buffers (``EmaAnchor``'s order), FSDP wrapper prefixes removed."""
    out = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
    out += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    return [(_strip(n), t) for n, t in out]


def _strip(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def paired_local_shards(anchor: nn.Module, policy: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(anchor shards, policy shards), aligned by name; raises if names, meshes or shard shapes differ."""
    a, p = dict(floating_state(anchor)), dict(floating_state(policy))
    if a.keys() != p.keys():
        missing, extra = sorted(a.keys() - p.keys()), sorted(p.keys() - a.keys())
        raise ValueError(f"anchor and policy tensors differ: only in anchor {missing[:5]}, only in policy {extra[:5]}")
    out_a, out_p = [], []
    for name, ta in a.items():
        tp = p[name]
        if _is_dtensor(ta) != _is_dtensor(tp):
            raise ValueError(f"{name}: anchor and policy are not both sharded (DTensor) or both plain")
        if _is_dtensor(ta) and (
            ta.placements != tp.placements or ta.device_mesh.mesh.tolist() != tp.device_mesh.mesh.tolist()
        ):
            raise ValueError(
                f"{name}: anchor placements {ta.placements} / mesh {ta.device_mesh.mesh.tolist()} differ from "
                f"the policy's {tp.placements} / {tp.device_mesh.mesh.tolist()}; set "
                "actor_rollout_ref.ref.fsdp_config.fsdp_size equal to the actor's"
            )
        la, lp = _local(ta), _local(tp)
        if la.shape != lp.shape:
            raise ValueError(f"{name}: local shard shapes differ (anchor {tuple(la.shape)}, policy {tuple(lp.shape)})")
        out_a.append(la)
        out_p.append(lp)
    return out_a, out_p


@torch.no_grad()
def wait_for_offload() -> None:
    """Before host code reads the actor's weights. verl offloads them with ``module.to("cpu", non_blocking=True)``
    (``verl.utils.fsdp_utils.offload_fsdp2_model_to_cpu``): the host tensors hold the values only once the
    device-to-host copies finished. A no-op without an accelerator (verl's CPU platform included)."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def ema_update_sharded_(anchor: nn.Module, policy: nn.Module, tau: float) -> None:
    """In place on this rank's shards: anchor <- tau * anchor + (1 - tau) * policy (tau = paper's eta). Call on
    every rank, after the optimizer step (parameters resharded)."""
    ema_update_(*paired_local_shards(anchor, policy), tau)


def _counted_once(t: torch.Tensor, rank: int) -> bool:
    """True if this rank's part of ``t`` must enter a global sum (shards: always; replicas: one rank)."""
    if not _is_dtensor(t):
        return rank == 0
    coord = t.device_mesh.get_coordinate() or []
    return all(c == 0 for c, pl in zip(coord, t.placements) if pl.is_replicate())


@torch.no_grad()
def drift(anchor: nn.Module, policy: nn.Module) -> dict[str, float]:
    """anchor/drift = ||theta - theta_ema|| / ||theta||, anchor/dist = ||theta - theta_ema|| (fp32, all ranks)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    a, p = dict(floating_state(anchor)), dict(floating_state(policy))
    sums = torch.zeros(2, dtype=torch.float64)
    for name, ta in a.items():
        if not _counted_once(ta, rank):
            continue
        la = _local(ta).float()
        lp = _local(p[name]).to(la.device, torch.float32)
        sums[0] += (la - lp).pow(2).sum().double().cpu()
        sums[1] += lp.pow(2).sum().double().cpu()
    dist_norm, norm = _all_reduce_sum(sums).sqrt().tolist()
    return {"anchor/drift": dist_norm / max(norm, 1e-12), "anchor/dist": dist_norm}


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    y = x.to(dev)
    dist.all_reduce(y)
    return y.cpu()
