"""The plugin's attention for verl's packed batches without flash-attn (experiments/backends/verl/attention.py).

On the CPU: the sequences read from position ids (packed, left- and right-padded rows), a tiny Qwen2 through it
against each sequence's own eager forward (logits and gradients), the refusals, and which attention a verl
launch gets. On CUDA (marked ``gpu``, ``make test-gpu``): PyTorch's varlen kernel in bf16 against the fp32
per-sequence reference. Through verl's FSDP2 engine: tests/verl/test_attention.py.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from experiments.backends.verl import attention

LENGTHS = [1, 5, 1, 9, 3]  # a packed row: sequences of one token at its start and in its middle


def _position_ids(lengths) -> torch.Tensor:
    """(1, sum(lengths)): positions restarting at 0 for each sequence, as verl packs a micro-batch."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize(
    "position_ids,offsets",
    [
        ([[0, 0, 1, 2, 0, 1]], [0, 1, 4, 6]),  # packed
        ([[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]], [0, 1, 2, 5, 8, 9, 10]),  # left pads, right pads: each a sequence
        ([[3, 4, 5]], [0, 3]),  # a sequence that does not start at 0
    ],
)
def test_sequence_offsets(position_ids, offsets):
    got = attention.sequence_offsets(torch.tensor(position_ids))
    assert got.dtype == torch.int32 and got.tolist() == offsets


def _models(seed: int = 0):
    """(the tiny Qwen2 with eager attention, the same weights with ours); 4 query heads share 2 key/value heads."""
    attention.register()
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    ref = Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager")
    ours = Qwen2ForCausalLM._from_config(cfg, attn_implementation=attention.NAME)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_packed_forward_and_backward_equal_each_sequence_alone():
    ref, ours = _models()
    ids = torch.randint(0, 64, (sum(LENGTHS),), generator=torch.Generator().manual_seed(1))
    packed = ours(input_ids=ids[None], position_ids=_position_ids(LENGTHS)).logits[0]  # (N, V)
    alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in ids.split(LENGTHS)])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    w = torch.randn(packed.shape, generator=torch.Generator().manual_seed(2))
    (packed * w).sum().backward()
    (alone * w).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_sequences_are_found_once_per_forward(monkeypatch):
    """Every layer gets the same position ids: the offsets (a GPU sync each) are computed for the first layer only,
    and again for new position ids."""
    _, ours = _models()
    calls = []
    find = attention.sequence_offsets
    monkeypatch.setattr(attention, "sequence_offsets", lambda pos: calls.append(pos) or find(pos))
    ids = torch.randint(0, 64, (1, sum(LENGTHS)))
    with torch.no_grad():
        ours(input_ids=ids, position_ids=_position_ids(LENGTHS))  # 2 layers
        ours(input_ids=ids, position_ids=_position_ids(LENGTHS))
    assert len(calls) == 2


def test_padded_rows_equal_each_sequence_alone():
    """verl's layout without use_remove_padding: left-padded prompts, right-padded responses, positions from the
    attention mask (pads repeat a position); no mask reaches a custom attention, the positions suffice."""
    ref, ours = _models()
    am = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    ids = torch.randint(0, 64, am.shape, generator=torch.Generator().manual_seed(3))
    pos = (am.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        z = ours(input_ids=ids, position_ids=pos).logits
        for row in range(2):
            keep = am[row].bool()
            torch.testing.assert_close(
                z[row, keep], ref(input_ids=ids[row, keep][None]).logits[0], atol=1e-5, rtol=1e-5
            )


def test_control_one_sequence_per_row_leaks(monkeypatch):
    ref, ours = _models()
    monkeypatch.setattr(attention, "sequence_offsets", lambda pos: torch.tensor([0, pos.numel()], dtype=torch.int32))
    ids = torch.randint(0, 64, (sum(LENGTHS),), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = ours(input_ids=ids[None], position_ids=_position_ids(LENGTHS)).logits[0]
        alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in ids.split(LENGTHS)])
    assert (packed - alone).abs().max() > 1e-2


def test_generation_with_a_cache_is_refused():
    """Decoding attends from one new token to a cache: no whole sequences to read from the position ids."""
    _, ours = _models()
    with pytest.raises(ValueError, match="for generation with a cache use sdpa"):
        ours.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize(
    "explicit,device,flash_attn,chosen",
    [
        (None, "cuda", False, attention.NAME),
        (None, "cuda", True, "flash_attention_2"),
        (None, "cpu", False, "eager"),
        ("sdpa", "cuda", False, "sdpa"),
    ],
)
def test_choose(monkeypatch, explicit, device, flash_attn, chosen):
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: flash_attn)
    name, why = attention.choose(explicit, device)
    assert name == chosen and "backend.verl.attn_implementation" in why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_varlen_kernel_matches_the_fp32_reference(record_property):
    """bf16 through torch's varlen kernel against fp32 per-sequence sdpa on the same inputs: outputs and
    gradients within bf16's rounding (relative to each tensor's largest magnitude)."""
    assert attention.varlen_attn is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    lengths, hq, hkv, d = [1, 37, 256, 5, 130], 8, 2, 64
    n = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", generator=g) for h in (hq, hkv, hkv))
    module = type("Attn", (), {"is_causal": True})()
    pos = _position_ids(lengths).cuda()

    def run(dtype):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention.varlen_attention(module, *x, None, position_ids=pos)[0]
        out.float().square().sum().backward()
        return [out.float()] + [t.grad.float() for t in x]

    fast = run(torch.bfloat16)
    exact = run(torch.float32)  # fp32: causal sdpa per sequence
    for name, a, b in zip(["out", "dq", "dk", "dv"], fast, exact, strict=True):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        record_property(f"{name}_max_rel_err", rel)
        assert rel < 2e-2, name
    record_property("gqa", "enable_gqa" if attention.GQA else "repeated heads")
