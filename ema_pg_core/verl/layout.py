"""verl's packed full-sequence layout <-> our response layout.

Shapes: B sequences, T response width, nnz = total prompt+response tokens of a micro-batch (verl's
"remove padding" packing), K top-k.

verl engines return per-position tensors packed over full sequences, (nnz, *), where position j
holds what the model predicts for token j + 1. ``verl.workers.utils.padding.no_padding_2_padding``
turns them into response layout (B, T, *): response token t of sequence b is predicted at packed
position ``seq_end_b - resp_len_b - 1 + t``. ``response_to_packed`` is its inverse on those
positions (zeros elsewhere) and is differentiable, so a per-token (B, T) quantity computed in
response layout can travel through verl's per-token (1, nnz) logits-processor channel.
"""

from __future__ import annotations

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


def packed_to_response(packed: torch.Tensor, data) -> torch.Tensor:
    """(nnz, *) or nested -> (B, T, *) zero-padded: verl's own ``no_padding_2_padding``."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(packed, data)


def response_to_packed(x: torch.Tensor, data, nnz: int) -> torch.Tensor:
    """(B, T, *) -> (nnz, *): response values at their predicting positions, zeros elsewhere.

    Differentiable in ``x``; the inverse of ``packed_to_response`` on response positions.
    """
    p_len, r_len, width = lengths(data)
    idx, valid = response_index(p_len.to(x.device), r_len.to(x.device), x.shape[1])
    if x.shape[1] < width and bool((r_len > x.shape[1]).any()):
        raise ValueError(f"response tensor width {x.shape[1]} < longest response {int(r_len.max())}")
    out = x.new_zeros((nnz, *x.shape[2:]))
    return out.index_put((idx[valid],), x[valid])


def padded_response(t: torch.Tensor, batch: int, width: int, fill: float = 0.0) -> torch.Tensor:
    """A response-layout tensor (nested (B, j, *) or padded (B, T', *)) as padded (B, width, *)."""
    if t.is_nested:
        return torch.nested.to_padded_tensor(t, fill, output_size=(batch, width, *t.shape[2:]))
    if t.shape[1] == width:
        return t
    if t.shape[1] > width:
        return t[:, :width]
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)
    return torch.cat([t, pad], 1)
