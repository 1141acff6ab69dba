"""Attention without flash-attn (docs/verl-plugin.md, "Installing on GPUs").

verl 0.9.1's FSDP engine packs a micro-batch into one row when use_remove_padding is on (attention_mask None,
position ids restarting at 0 for each sequence). flash-attn's varlen kernel is what verl patches in for that;
with sdpa (the GPU presets' attention, ``backend.verl.attn_implementation``), transformers builds a
block-diagonal causal mask from those position ids instead, so that each sequence attends to itself only. The
engine's log-probs then equal a plain forward of each sequence alone, for both of verl's layouts; with
transformers' detection of the packed sequences switched off (the control), they do not: the test sees a
leak across sequences. What it costs on a GPU: docs/benchmarks.md, "sdpa for packed batches on a GPU".
"""

import engines
import pytest
import torch

pytestmark = pytest.mark.verl


def _log_probs(tiny_path, attn: str, remove_padding: bool = True):
    """(B, R) log-probs of the test batch from verl's engine, the (B, R) plain per-sequence ones, the mask."""
    from verl.workers.utils.padding import no_padding_2_padding

    w = engines.training_worker(tiny_path, forward_only=True, remove_padding=remove_padding, attn=attn)
    td, padded = engines.batch()
    verl_lp = no_padding_2_padding(w.infer_batch(td)["log_probs"], td)
    plain = engines.plain_model(tiny_path).eval()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in w.engine.module.state_dict().items()}
    plain.load_state_dict({n: p.detach() for n, p in full.items()}, strict=False)
    with torch.no_grad():
        z = engines.naive_logits(plain, padded)
    naive = torch.log_softmax(z, -1).gather(-1, padded["responses"][..., None])[..., 0]
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
