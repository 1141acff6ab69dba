"""GRPO group advantages (docs/algorithm.md, "Group advantages"). One registry, ``ADVANTAGES``.

Each response gets its scalar outcome reward R; within its group (same prompt id):
    grpo:    A = (R - mean_g) / (std_g + eps), std unbiased (N - 1), as verl's norm_adv_by_std_in_grpo
    dr_grpo: A = R - mean_g (mean-only, Dr. GRPO)
A group of size 1 gets mean 0 and std 1 (verl), so its advantage is R / (1 + eps) under grpo.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response (B,) group mean, unbiased group std and group size."""
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    G = counts.numel()
    sums = torch.zeros(G, dtype=rewards.dtype, device=rewards.device).index_add_(0, inv, rewards)
    mean = sums / counts
    sq = torch.zeros(G, dtype=rewards.dtype, device=rewards.device).index_add_(0, inv, (rewards - mean[inv]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp_min(1))
    single = counts == 1
    mean, std = torch.where(single, 0.0, mean), torch.where(single, 1.0, std)
    return mean[inv], std[inv], counts[inv]


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    mean, std, _ = _group_stats(rewards, group_ids)
    return (rewards - mean) / (std + eps)


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    mean, _, _ = _group_stats(rewards, group_ids)
    return rewards - mean


ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {"grpo": grpo, "dr_grpo": dr_grpo}


def compute_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, mode: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """(B,) per-sequence advantages from (B,) rewards and (B,) integer group ids."""
    if mode not in ADVANTAGES:
        raise ValueError(f"advantage mode {mode!r} unknown; allowed: {', '.join(ADVANTAGES)}")
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be (B,)")
    return ADVANTAGES[mode](
        rewards.to(torch.get_default_dtype()) if not rewards.is_floating_point() else rewards, group_ids, eps
    )
