"""Layout helpers: ``Layout`` is verl's no_padding_2_padding with the positions derived once, and its inverse on
response positions (values and gradients), for verl's padded (V0-style) and nested (V1 TransferQueue) batches."""

import engines
import pytest
import torch

pytestmark = pytest.mark.verl


def _nested_batch(td):
    """The same batch with prompts/responses as nested tensors, as verl's V1 agent loop stores them."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    am, P = td["attention_mask"], td["prompts"].shape[1]
    prompts = [td["prompts"][i][am[i, :P].bool()] for i in range(am.shape[0])]
    responses = [td["responses"][i][am[i, P:].bool()] for i in range(am.shape[0])]
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    out = TensorDict(
        {"prompts": nested(prompts), "responses": nested(responses), "input_ids": td["input_ids"]},
        batch_size=am.shape[0],
    )
    tu.assign_non_tensor(out, max_response_len=-1)
    return out


@pytest.mark.parametrize("nested", [False, True], ids=["padded", "nested"])
def test_layout_packed_inverts_no_padding_2_padding(verl_cpu, nested):
    from verl.workers.utils.padding import no_padding_2_padding

    from experiments.backends.verl.layout import Layout, padded_response

    td, padded = engines.batch()
    if nested:
        td = _nested_batch(td)
    nnz = td["input_ids"].values().shape[0]
    packed = torch.randn(nnz, 3, requires_grad=True)
    resp = no_padding_2_padding(packed, td)  # (B, T, 3)
    mask = padded["response_mask"].bool()[:, : resp.shape[1]]
    back = Layout.of(td).packed(resp)
    # positions that predict a response token round-trip; all others are zero
    resp_pos = back.abs().sum(-1) > 0
    assert torch.equal(back[resp_pos], packed[resp_pos]) and int(resp_pos.sum()) == int(mask.sum())
    (back * torch.arange(nnz)[:, None]).sum().backward()
    assert torch.equal(packed.grad[resp_pos], torch.arange(nnz)[resp_pos][:, None].expand(-1, 3).float())
    assert packed.grad[~resp_pos].abs().sum() == 0
    # response-layout inputs of either kind come out at the same width
    old = padded["old_log_probs"]
    src = torch.nested.as_nested_tensor([old[i][mask[i]] for i in range(4)], layout=torch.jagged) if nested else old
    got = padded_response(src, 4, resp.shape[1])
    assert got.shape == resp.shape[:2] and torch.equal(got[mask], old[:, : resp.shape[1]][mask])


@pytest.mark.parametrize("nested", [False, True], ids=["padded", "nested"])
def test_layout_is_no_padding_2_padding_with_the_positions_computed_once(verl_cpu, nested):
    """Values (float and integer fields, with and without a trailing dimension) and gradients equal verl's own
    conversion bit for bit; ``packed`` inverts it on the response positions; a field of another micro-batch is
    refused."""
    from verl.workers.utils.padding import no_padding_2_padding

    from experiments.backends.verl.layout import Layout

    td, _ = engines.batch()
    if nested:
        td = _nested_batch(td)
    nnz = td["input_ids"].values().shape[0]
    lay = Layout.of(td)
    assert lay.nnz == nnz
    for packed in (torch.randn(nnz), torch.randn(nnz, 3), torch.randint(0, 100, (nnz, 5))):
        assert torch.equal(lay.response(packed), no_padding_2_padding(packed, td))
    nested_field = torch.nested.nested_tensor_from_jagged(torch.randn(nnz), td["input_ids"].offsets())
    assert torch.equal(lay.response(nested_field), no_padding_2_padding(nested_field, td))
    grads = []
    for convert in (lay.response, lambda p: no_padding_2_padding(p, td)):
        packed = torch.linspace(-1, 1, nnz * 3).view(nnz, 3).requires_grad_()
        resp = convert(packed)
        (resp * torch.arange(resp.numel()).view(resp.shape)).sum().backward()
        grads.append(packed.grad)
    assert torch.equal(*grads) and grads[0].abs().sum() > 0
    resp = lay.response(torch.randn(nnz, 3))
    with pytest.raises(ValueError, match=f"expected {nnz} packed tokens; got {nnz + 1}"):
        lay.response(torch.randn(nnz + 1))
    with pytest.raises(ValueError, match="expected a"):
        lay.packed(resp[:, :-1])
