"""Attention without flash-attn (docs/verl-plugin.md, "Installing on GPUs").

verl 0.9.1's FSDP engine packs a micro-batch into one row when use_remove_padding is on (attention_mask None,
position ids restarting at 0 for each sequence). flash-attn's varlen kernel is what verl patches in for that;
with sdpa (the GPU presets' attention, ``backend.verl.attn_implementation``), transformers builds a
block-diagonal causal mask from those position ids instead, so that each sequence attends to itself only. The
engine's log-probs then equal a plain forward of each sequence alone, for both of verl's layouts; with
transformers' detection of the packed sequences switched off (the control), they do not: the test sees a
leak across sequences. What it costs on a GPU: docs/benchmarks.md, "sdpa for packed batches on a GPU".

The plugin's own attention for GPUs without flash-attn (``emapg_varlen``: PyTorch's varlen kernel on CUDA, causal
sdpa per sequence on the CPU) reads the sequences from the position ids alone; its log-probs and gradients through
verl's engine equal each sequence's plain forward, for several mixes of lengths.
"""

import engines
import pytest
import torch

from experiments.backends.verl import attention

pytestmark = pytest.mark.verl


MIXES = {  # (prompt, response) tokens of each sequence of a micro-batch
    "four": engines.LENGTHS,
    "one sequence": ((6, 7),),
    "shortest": ((1, 1), (6, 7), (1, 2)),  # a two-token sequence first, at the packed row's start
    "one token": ((6, 7), (1, 0), (3, 2)),  # a one-token sequence (a prompt, no response) in the row's middle
}


def _plain(w, tiny_path):
    """The tiny model with eager attention and the weights of verl's engine `w`."""
    plain = engines.plain_model(tiny_path)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in w.engine.module.state_dict().items()}
    plain.load_state_dict({n: p.detach() for n, p in full.items()}, strict=False)
    return plain


def _naive_log_probs(plain, padded) -> torch.Tensor:
    """(B, R) log-probs of the responses, one plain forward per sequence."""
    z = engines.naive_logits(plain, padded)
    return torch.log_softmax(z, -1).gather(-1, padded["responses"][..., None])[..., 0]


def _log_probs(tiny_path, attn: str, remove_padding: bool = True, lengths=engines.LENGTHS):
    """(B, R) log-probs of the test batch from verl's engine, the (B, R) plain per-sequence ones, the mask."""
    from verl.workers.utils.padding import no_padding_2_padding

    w = engines.training_worker(
        tiny_path, forward_only=True, remove_padding=remove_padding, micro=len(lengths), attn=attn
    )
    td, padded = engines.batch(lengths=lengths)
    verl_lp = no_padding_2_padding(w.infer_batch(td)["log_probs"], td)
    with torch.no_grad():
        naive = _naive_log_probs(_plain(w, tiny_path).eval(), padded)
    return verl_lp, naive, padded["response_mask"].bool()


@pytest.mark.parametrize("attn,remove_padding", [("sdpa", True), ("sdpa", False), ("eager", True)])
def test_verl_batches_without_flash_attn_equal_each_sequence_alone(tiny_path, attn, remove_padding):
    verl_lp, naive, mask = _log_probs(tiny_path, attn, remove_padding)
    torch.testing.assert_close(verl_lp[mask], naive[mask], atol=2e-5, rtol=1e-5)


def test_control_without_the_packed_sequence_mask_sequences_leak(tiny_path, monkeypatch):
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    verl_lp, naive, mask = _log_probs(tiny_path, "sdpa")
    assert (verl_lp - naive).abs()[mask].max() > 1e-2


@pytest.mark.parametrize("lengths", MIXES.values(), ids=MIXES)
@pytest.mark.parametrize("remove_padding", [True, False])
def test_varlen_log_probs_equal_each_sequence_alone(tiny_path, lengths, remove_padding):
    attention.register()
    verl_lp, naive, mask = _log_probs(tiny_path, attention.NAME, remove_padding, lengths)
    torch.testing.assert_close(verl_lp[mask], naive[mask], atol=2e-5, rtol=1e-5)


def _sum_log_probs(model_output, data, dp_group=None):
    """A verl loss function: minus the sum of the responses' log-probs."""
    from verl.workers.utils.padding import no_padding_2_padding

    return -(no_padding_2_padding(model_output["log_probs"], data) * data["response_mask"]).sum(), {}


@pytest.mark.parametrize("lengths", MIXES.values(), ids=MIXES)
def test_varlen_gradients_equal_each_sequence_alone(tiny_path, lengths):
    """One backward pass through verl's engine (a packed micro-batch) against the plain model's, sequence by
    sequence, for every parameter."""
    attention.register()
    from verl.utils import tensordict_utils as tu

    w = engines.training_worker(tiny_path, forward_only=False, micro=len(lengths), attn=attention.NAME)
    plain = _plain(w, tiny_path)
    td, padded = engines.batch(lengths=lengths)
    engines.train_flags(td)
    tu.assign_non_tensor(td, micro_batch_size_per_gpu=len(lengths))  # one packed micro-batch
    w.engine.optimizer_zero_grad()
    with w.engine.train_mode():
        w.engine.forward_backward_batch(td, loss_function=_sum_log_probs, forward_only=False)
        grads = {n: p.grad.full_tensor() for n, p in w.engine.module.named_parameters() if p.grad is not None}
    (-(_naive_log_probs(plain, padded) * padded["response_mask"]).sum()).backward()
    expected = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys() and len(grads) > 10
    for n, g in grads.items():
        torch.testing.assert_close(g, expected[n], atol=1e-5, rtol=1e-4, msg=n)


def test_control_varlen_over_the_whole_row_leaks(tiny_path, monkeypatch):
    """The control: with the packed row taken as one sequence, the varlen log-probs differ from each sequence's."""
    attention.register()
    monkeypatch.setattr(attention, "sequence_offsets", lambda pos: torch.tensor([0, pos.numel()], dtype=torch.int32))
    verl_lp, naive, mask = _log_probs(tiny_path, attention.NAME)
    assert (verl_lp - naive).abs()[mask].max() > 1e-2
