"""verl's packed full-sequence layout <-> our response layout.

Shapes: B sequences, T response width, nnz = prompt+response tokens of a micro-batch (verl's remove-padding
packing), K top-k. Packed position j holds what the model predicts for token j + 1, so response token t of
sequence b is predicted at ``seq_end_b - resp_len_b - 1 + t``.

``Layout.response`` gives ``verl.workers.utils.padding.no_padding_2_padding``'s values and gradients exactly
(tested) and ``Layout.packed`` is its differentiable inverse, the positions derived once per micro-batch
(``no_padding_2_padding`` derives them again, with a host sync, for each of the loss's dozen fields).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def lengths(data) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(prompt_lens (B,), response_lens (B,), T) exactly as ``no_padding_2_padding`` derives them."""
    from verl.utils import tensordict_utils as tu

    prompts, responses = data["prompts"], data["responses"]
    width = tu.get_non_tensor_data(data=data, key="max_response_len", default=-1)
    if prompts.is_nested:
        p_len, r_len = prompts.offsets().diff(), responses.offsets().diff()
        if width < 0:
            width = int(r_len.max().item())
    else:
        am = data["attention_mask"]
        p_len, r_len = am[:, : prompts.shape[1]].sum(1), am[:, prompts.shape[1] :].sum(1)
        width = responses.shape[1]
    return p_len, r_len, int(width)


def token_rows(offsets: torch.Tensor) -> torch.Tensor:
    """(nnz,) row of each token of a jagged nested tensor with these offsets (B + 1,)."""
    lengths = offsets.diff()  # (B,)
    return torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths)


def response_index(
    prompt_lens: torch.Tensor, response_lens: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx (B, T) int64 packed position predicting response token t, valid (B, T) bool)."""
    if (prompt_lens <= 0).any():
        raise ValueError("every sequence needs a prompt token (the first response token is predicted from it)")
    ends = (prompt_lens + response_lens).cumsum(0)
    start = ends - response_lens - 1  # (B,)
    t = torch.arange(width, device=start.device)
    valid = t[None, :] < response_lens[:, None]
    idx = torch.where(valid, start[:, None] + t[None, :], torch.zeros_like(valid, dtype=start.dtype))
    return idx.long(), valid


@dataclass(frozen=True)
class Layout:
    """One micro-batch's map between verl's packed positions (nnz,) and the response layout (B, T)."""

    idx: torch.Tensor  # (B, T) int64: the packed position predicting response token t (0 past the response's end)
    valid: torch.Tensor  # (B, T) bool: t < the response's length
    nnz: int  # packed tokens in the micro-batch (prompts and responses)

    @classmethod
    def of(cls, data) -> Layout:
        """The positions of `data`'s sequences, derived as ``no_padding_2_padding`` derives them."""
        p_len, r_len, width = lengths(data)
        idx, valid = response_index(p_len, r_len, width)
        return cls(idx, valid, int((p_len + r_len).sum()))

    def response(self, packed: torch.Tensor) -> torch.Tensor:
        """(nnz, *) or nested -> (B, T, *), zero past each response's end; differentiable."""
        values = packed.values() if packed.is_nested else packed
        if values.shape[0] != self.nnz:
            raise ValueError(f"expected {self.nnz} packed tokens; got {values.shape[0]}")
        keep = self.valid.to(values.device).view(*self.valid.shape, *(1,) * (values.ndim - 1))  # (B, T, 1, ...)
        return torch.where(keep, values[self.idx.to(values.device)], values.new_zeros(()))

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, *) -> (nnz, *): the response values at their predicting positions, zeros elsewhere;
        differentiable in `x`."""
        if tuple(x.shape[:2]) != tuple(self.idx.shape):
            raise ValueError(f"expected a ({self.idx.shape[0]}, {self.idx.shape[1]}, ...) tensor; got {tuple(x.shape)}")
        valid = self.valid.to(x.device)
        return x.new_zeros((self.nnz, *x.shape[2:])).index_put((self.idx.to(x.device)[valid],), x[valid])


def padded_response(t: torch.Tensor, batch: int, width: int, fill: float = 0.0) -> torch.Tensor:
    """A response-layout tensor (nested (B, j, *) or padded (B, T', *)) as padded (B, width, *)."""
    if t.is_nested:
        return torch.nested.to_padded_tensor(t, fill, output_size=(batch, width, *t.shape[2:]))
    if t.shape[1] >= width:
        return t[:, :width]
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)
    return torch.cat([t, pad], 1)
