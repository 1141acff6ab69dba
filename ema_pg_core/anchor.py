"""The EMA anchor (ema-pg.md §1.1): theta_ema <- tau * theta_ema + (1 - tau) * theta.

``tau`` is the paper's eta (the weight on the old anchor). The update runs after the policy
update of iterations period, 2*period, ... (iterations count rollout batches from 1, as in the
released code's ``global_steps``), so with period 10 the anchor is frozen for iterations 1-10,
then updated once, and so on. The anchor starts equal to the initial policy. tau = 1 is a fixed
anchor (plain GRPO); tau = 0 copies the policy.

Mixed: every floating parameter and every floating buffer (integer buffers such as position
ids are constants and are skipped). The mix is one multi-tensor ``torch._foreach_lerp_`` call,
no Python loop per parameter. With ``fp32_shadow`` the mix runs on an fp32 copy and the module
(e.g. bf16) receives the rounded result, so small (1 - tau) steps are not rounded away.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def _floating_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Named floating parameters and buffers, in a stable order."""
    out = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
    out += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    return out


@torch.no_grad()
def ema_update_(anchor: list[torch.Tensor], policy: list[torch.Tensor], tau: float) -> None:
    """In place: anchor[i] <- tau * anchor[i] + (1 - tau) * policy[i], one fused multi-tensor op.

    ``lerp(start, end, w) = start + w (end - start) = (1 - w) start + w end`` with w = 1 - tau.
    Policy tensors are cast to each anchor tensor's dtype/device first when they differ.
    """
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must be in [0, 1]; got {tau!r}")
    if len(anchor) != len(policy):
        raise ValueError(f"anchor has {len(anchor)} tensors, policy {len(policy)}")
    if tau == 1.0 or not anchor:
        return
    src = [p if (p.dtype == a.dtype and p.device == a.device) else p.to(a.device, a.dtype) for a, p in zip(anchor, policy)]
    torch._foreach_lerp_(anchor, src, 1.0 - tau)


class EmaAnchor:
    """Owns the anchor network, its schedule and (optionally) an fp32 shadow.

    Args:
        policy: the policy module at initialisation; the anchor is a deep copy of it.
        tau: weight on the old anchor (paper's eta), in [0, 1].
        period: update every ``period`` training iterations (>= 1).
        fp32_shadow: mix in fp32 and copy the result into the (lower precision) anchor module.
    """

    def __init__(self, policy: nn.Module, tau: float, period: int, fp32_shadow: bool = False):
        if not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1]; got {tau!r}")
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be an integer >= 1; got {period!r}")
        self.tau, self.period = float(tau), period
        self.module = copy.deepcopy(policy).eval().requires_grad_(False)
        self._names = [n for n, _ in _floating_state(self.module)]
        self.shadow = [t.detach().float().clone() for _, t in _floating_state(self.module)] if fp32_shadow else None
        self.num_updates = 0

    # ----------------------------------------------------------------- schedule
    def due(self, iteration: int) -> bool:
        """True when the anchor is updated after iteration ``iteration`` (1-based)."""
        return self.tau < 1.0 and iteration > 0 and iteration % self.period == 0

    @torch.no_grad()
    def update(self, iteration: int, policy: nn.Module) -> bool:
        """Call once after the policy update of ``iteration``; returns whether the anchor changed."""
        if not self.due(iteration):
            return False
        policy_state = dict(_floating_state(policy))
        missing = [n for n in self._names if n not in policy_state]
        if missing:
            raise ValueError(f"policy lacks anchor tensors: {missing[:5]}")
        src = [policy_state[n] for n in self._names]
        targets = [t for _, t in _floating_state(self.module)]
        if self.shadow is None:
            ema_update_(targets, src, self.tau)
        else:
            ema_update_(self.shadow, src, self.tau)
            torch._foreach_copy_(targets, self.shadow)
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
            "period": self.period,
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
