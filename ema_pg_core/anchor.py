"""The EMA anchor (docs/algorithm.md, "The EMA anchor"): theta_ema <- tau * theta_ema + (1 - tau) * theta.

``tau`` is the paper's eta. The update runs after the policy update of iterations period, 2*period, ...
(counted from 1, as the released code's ``global_steps``); the anchor starts equal to the initial policy;
tau = 1 is a fixed anchor (plain GRPO), tau = 0 copies the policy. Every floating parameter and buffer is
mixed (integer buffers are constants) by one multi-tensor ``torch._foreach_lerp_``. With ``fp32_shadow`` the
mix runs on an fp32 copy and the module (e.g. bf16) receives the rounded result, so small (1 - tau) steps are
not rounded away. Throughput: docs/benchmarks.md.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ema_pg_core.config import AnchorConfig


def _floating_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Named floating parameters and buffers, in a stable order."""
    out = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
    out += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    return out


SLICE = 1 << 20  # elements per slice when dtypes differ: on a CPU the cast slice (4 MB in fp32) stays in cache
DEVICE_SLICE = 1 << 26  # on an accelerator: few kernel launches per tensor, a cast temporary of at most 256 MB


def _same(a: torch.Tensor, p: torch.Tensor) -> bool:
    return p.dtype == a.dtype and p.device == a.device


@torch.no_grad()
def _lerp_cast_(a: torch.Tensor, p: torch.Tensor, w: float, out: torch.Tensor | None = None) -> None:
    """a <- lerp(a, p cast to a's dtype/device, w) [then out <- a], over flat slices: casting the whole policy
    first would allocate a full copy of it and stream it through memory twice more."""
    if a.shape != p.shape:
        raise ValueError(f"anchor tensor shape {tuple(a.shape)} != policy tensor shape {tuple(p.shape)}")
    if not (a.is_contiguous() and p.is_contiguous() and (out is None or out.is_contiguous())):
        a.lerp_(p.to(a.device, a.dtype), w)
        if out is not None:
            out.copy_(a)
        return
    fa, fp, fo = a.view(-1), p.view(-1), None if out is None else out.view(-1)
    step = SLICE if a.device.type == "cpu" else DEVICE_SLICE
    for i in range(0, fa.numel(), step):
        sl = slice(i, i + step)
        fa[sl].lerp_(fp[sl].to(a.device, a.dtype), w)
        if fo is not None:
            fo[sl].copy_(fa[sl])


@torch.no_grad()
def ema_update_(anchor: list[torch.Tensor], policy: list[torch.Tensor], tau: float) -> None:
    """In place: anchor[i] <- tau * anchor[i] + (1 - tau) * policy[i] = lerp(anchor[i], policy[i], 1 - tau), tau in
    [0, 1] (checked by AnchorConfig); pairs of different dtype/device are cast slice by slice."""
    if len(anchor) != len(policy):
        raise ValueError(f"anchor has {len(anchor)} tensors, policy {len(policy)}")
    if tau == 1.0 or not anchor:
        return
    same = [_same(a, p) for a, p in zip(anchor, policy)]
    if any(same):
        torch._foreach_lerp_([a for a, s in zip(anchor, same) if s], [p for p, s in zip(policy, same) if s], 1.0 - tau)
    for a, p, s in zip(anchor, policy, same):
        if not s:
            _lerp_cast_(a, p, 1.0 - tau)


@torch.no_grad()
def _shadow_update_(
    shadow: list[torch.Tensor], targets: list[torch.Tensor], policy: list[torch.Tensor], tau: float
) -> None:
    """shadow <- lerp(shadow, policy, 1 - tau); targets <- shadow (rounded to their dtype); slice by slice when any
    cast is needed, so the policy cast and the shadow are read from memory once."""
    if all(_same(a, p) for a, p in zip(shadow, policy)):
        torch._foreach_lerp_(shadow, list(policy), 1.0 - tau)
        torch._foreach_copy_(targets, shadow)
        return
    for s, t, p in zip(shadow, targets, policy):
        _lerp_cast_(s, p, 1.0 - tau, out=t)


class EmaAnchor:
    """Owns the anchor network (a deep copy of the initial policy), its schedule and (optionally) an fp32 shadow."""

    def __init__(self, policy: nn.Module, cfg: AnchorConfig):
        self.cfg, self.tau = cfg, float(cfg.tau)
        self.module = copy.deepcopy(policy).eval().requires_grad_(False)
        self._names = [n for n, _ in _floating_state(self.module)]
        self.shadow = [t.detach().float().clone() for _, t in _floating_state(self.module)] if cfg.fp32_shadow else None
        self.num_updates = 0

    @torch.no_grad()
    def update(self, iteration: int, policy: nn.Module) -> bool:
        """Call once after the policy update of ``iteration``; returns whether the anchor changed."""
        if not self.cfg.due(iteration):
            return False
        policy_state = dict(_floating_state(policy))  # the anchor is a copy of the policy: the same names
        src = [policy_state[n] for n in self._names]
        targets = [t for _, t in _floating_state(self.module)]
        if self.shadow is None:
            ema_update_(targets, src, self.tau)
        else:
            _shadow_update_(self.shadow, targets, src, self.tau)
        self.num_updates += 1
        return True

    # ----------------------------------------------------------------- metrics
    @torch.no_grad()
    def drift(self, policy: nn.Module) -> dict[str, float]:
        """anchor/drift = ||theta - theta_ema|| / ||theta|| over all floating tensors (fp32 math)."""
        pol = dict(_floating_state(policy))
        anc = self.shadow if self.shadow is not None else [t for _, t in _floating_state(self.module)]
        p = [pol[n].float() for n in self._names]
        diff = torch._foreach_sub([a.float() for a in anc], p)
        dn = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(diff))).item()
        pn = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(p))).item()
        return {"anchor/drift": dn / max(pn, 1e-12), "anchor/dist": dn, "anchor/num_updates": float(self.num_updates)}

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "tau": self.tau,
            "period": self.cfg.period,
            "num_updates": self.num_updates,
            "module": self.module.state_dict(),
            "shadow": None if self.shadow is None else [t.clone() for t in self.shadow],
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["shadow"] is None) != (self.shadow is None):
            raise ValueError("anchor checkpoint and this anchor disagree on fp32_shadow")
        self.module.load_state_dict(state["module"])
        if self.shadow is not None:
            torch._foreach_copy_(self.shadow, state["shadow"])
        self.num_updates = int(state["num_updates"])
