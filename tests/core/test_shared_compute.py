"""Work the local trainer no longer repeats: a prompt's forward shared by its G samples, finished rows
dropped from the decode. Both must give the numbers of the plain computation, up to float rounding.
"""

import pytest
import torch

from ema_pg_core.local import rollout as rollout_mod
from ema_pg_core.local.batch import collate, length_chunks, prompt_groups, response_hidden
from ema_pg_core.local.rollout import Trajectory, rollout
from ema_pg_core.local.tiny import build_model, build_tokenizer
from tests.core.test_sampler_stats import _OnHash

TOK = build_tokenizer()
ATOL = 2e-5  # fp32 hidden states and statistics of O(1): two summation orders
GRAD_RTOL = 1e-5  # max |grad difference| / max |grad| per parameter tensor; measured <= 3e-7


def _model(seed=1):
    return build_model(TOK, hidden=32, layers=2, heads=2, seed=seed)


def _full_hidden(model, batch):
    """The plain computation: one forward over the right-padded (B, L) batch, gathered at pred_pos."""
    hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    return hidden.gather(1, batch.pred_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, T, H)


def _sample(model, prompts, **kw):
    return rollout(model, TOK, prompts, max_new_tokens=kw.pop("max_new_tokens", 14), **kw)


# ------------------------------------------------------------------ prompt groups
def _traj(prompt, response):
    return Trajectory(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response))


def test_prompt_groups_by_hand():
    b = collate([_traj([5, 6], [7]), _traj([5, 6, 7], [8, 9]), _traj([5, 6], [9, 9, 9]), _traj([5, 6, 7], [1])], 0)
    rows, inverse = prompt_groups(b)
    # distinct prompts [5, 6] (rows 0, 2) and [5, 6, 7] (rows 1, 3): the same prefix, a different length
    assert sorted(rows.tolist()) == [0, 1]
    assert inverse[0] == inverse[2] != inverse[1] == inverse[3]
    assert rows[inverse].tolist() == [0, 1, 0, 1]


def test_prompt_groups_none_without_repeats_or_with_one_token_prompts():
    assert prompt_groups(collate([_traj([5, 6], [7]), _traj([5, 7], [7])], 0)) is None
    assert prompt_groups(collate([_traj([5], [7]), _traj([5], [8])], 0)) is None  # length not readable


def test_length_chunks_by_hand():
    assert length_chunks([5, 5, 6, 6]) == [[0, 1, 2, 3]]  # a split would save 2 of 24 positions: not worth a call
    assert length_chunks([10, 1, 10, 1]) == [[1, 3], [0, 2]]  # saves 18 of 40 positions, one call costs 5
    lengths = [3, 40, 4, 41, 3, 90, 42, 4]
    chunks = length_chunks(lengths)
    assert chunks == [[0, 2, 4, 7], [1, 3, 6], [5]]  # 16 + 126 + 90 + 3 calls * 90 = 502 < 720 + 90 in one
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    assert len(length_chunks(list(range(1, 100)), max_chunks=2)) == 2 and length_chunks([]) == []


# ------------------------------------------------------------------ the shared-prompt forward
def _grouped_batch(model, env=None):
    """G = 3 samples of prompts of different lengths (right padding and mask holes exercised)."""
    g = torch.Generator().manual_seed(0)
    prompts = [p for p in ("1>", "23+4>", "5678>") for _ in range(3)]
    kw = dict(env=env, max_turns=2, temperature=2.0, max_new_tokens=30) if env else dict(temperature=1.5)
    trajs = _sample(model, prompts, generator=g, **kw)
    return collate(trajs, TOK.pad_token_id), trajs


@pytest.mark.parametrize("tool_loop", [False, True])
def test_shared_prompt_forward_equals_the_full_forward(tool_loop):
    model = _model().eval()
    batch, trajs = _grouped_batch(model, _OnHash() if tool_loop else None)
    lengths = [len(t.response_ids) for t in trajs]
    if tool_loop:  # environment tokens inside the responses, lengths far apart: responses in several chunks
        assert any(t.turns > 0 for t in trajs) and len(length_chunks(lengths)) > 1
    assert len({len(t.response_ids) for t in trajs}) > 1 and prompt_groups(batch) is not None
    real = torch.arange(batch.tokens.shape[1]) < torch.tensor([len(t.response_ids) for t in trajs])[:, None]
    w = torch.randn(*batch.tokens.shape, 32, generator=torch.Generator().manual_seed(1)) * real[..., None]
    got, ref = {}, {}
    for out, fn in ((got, response_hidden), (ref, _full_hidden)):
        model.zero_grad(set_to_none=True)
        h = fn(model, batch)  # (B, T, H)
        (h * w).sum().backward()  # a functional of every real response position
        out["h"], out["grad"] = h.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(got["h"][real], ref["h"][real], rtol=0, atol=ATOL)
    for n, g in ref["grad"].items():  # relative to the tensor's scale (embedding gradients reach O(100))
        assert (got["grad"][n] - g).abs().max() <= GRAD_RTOL * g.abs().max(), n


def test_shared_prompt_forward_is_what_response_hidden_runs():
    """The prompt rows go through the model once: U distinct prompts, then B response rows."""
    model = _model().eval()
    batch, _ = _grouped_batch(model)
    seen = []
    model.base_model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
    with torch.no_grad():
        response_hidden(model, batch)
    B, T = batch.tokens.shape
    assert seen == [(3, 5), (B, T)]  # 3 distinct prompts, the longest 5 tokens


# ------------------------------------------------------------------ finished rows leave the decode
def _ending_model():
    """(tiny model that ends rows at different steps, the batch size of each of its calls).

    A random tiny model rarely samples eos; this one is forced to wherever (token + position) % 4 == 0 past
    position 3, so rows finish at different steps under sampling and greedy decoding alike.
    """
    model, sizes = _model().eval(), []

    def force_eos(module, args, kw, out):
        pos = kw["position_ids"][:, -1]  # (b,)
        out.logits[((kw["input_ids"][:, -1] + pos) % 4 == 0) & (pos >= 4), -1, TOK.eos_token_id] = 30.0
        sizes.append(len(pos))
        return out

    model.register_forward_hook(force_eos, with_kwargs=True)
    return model, sizes


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(greedy=True),
     dict(temperature=2.0, env=_OnHash(), max_turns=2, max_new_tokens=30)],
)  # fmt: skip
def test_dropping_finished_rows_changes_no_sample(kw, monkeypatch):
    prompts = ["1>", "23>", "456>", "7>", "8>", "9>"] * 2
    runs = {}
    for shrink in (0.0, rollout_mod.SHRINK_AT):
        monkeypatch.setattr(rollout_mod, "SHRINK_AT", shrink)
        model, sizes = _ending_model()
        g = torch.Generator().manual_seed(0)
        runs[shrink] = _sample(model, prompts, generator=g, stats_k=None if kw.get("greedy") else 4, **kw), sizes
    (plain, plain_sizes), (shrunk, shrunk_sizes) = runs.values()
    assert len({len(t.response_ids) for t in plain}) > 2  # rows finished at different steps
    assert kw.get("env") or set(plain_sizes) == {len(prompts)}  # without dropping, every step runs every row
    assert min(shrunk_sizes) < len(prompts) and len(shrunk_sizes) == len(plain_sizes)  # rows left the batch
    for a, b in zip(plain, shrunk):
        assert a.response_ids == b.response_ids and a.response_mask == b.response_mask and a.turns == b.turns
        if a.stats is not None:
            for f in ("logp", "lse", "logits_k", "entropy"):
                torch.testing.assert_close(getattr(b.stats, f), getattr(a.stats, f), rtol=0, atol=ATOL)
