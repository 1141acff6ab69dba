"""The decode loop's speed work changes no sample: the same tokens, statistics and RNG draws as the loop before it.

``_reference_generate`` is ``ema_pg_core.local.rollout.generate`` as it was before that work (it ran one model
forward after the last sampled token, and divided the logits by a temperature of 1). ``rollout`` run on it
and on today's loop must give identical trajectories: token ids, masks, turns, texts, the sampler's
statistics bit for bit, and the generator left in the same state (the same random draws, in the same order).
"""

import pytest
import torch

import ema_pg_core.local.rollout as rollout_mod
from ema_pg_core.local.rollout import SHRINK_AT, _ender, _prefill, _prunable, _top_p_filter, generate, rollout
from tests.core.test_sampler_stats import TOK, _OnHash
from tests.core.test_shared_compute import _ending_model, _model


def _reference_pick(logits, temperature, top_p, greedy, generator):
    if greedy or temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    return torch.multinomial(_top_p_filter(probs, top_p), 1, generator=generator)[:, 0]


@torch.no_grad()
def _reference_generate(
    model, contexts, *, max_new_tokens, pad_id, eos_id, temperature=1.0, top_p=1.0, greedy=False, generator=None,
    stop=None, decode=None, on_step=None,
):  # fmt: skip
    B = len(contexts)
    device = next(model.parameters()).device
    out, attn, L = _prefill(model, contexts, pad_id, max_new_tokens, device)
    gen = [[] for _ in range(B)]
    live, ends = list(range(B)), _ender(eos_id, stop, decode)
    rows, sel = list(range(B)), None
    pos = attn[:, :L].sum(-1, keepdim=True) - 1
    for s in range(max_new_tokens):
        z = out.logits[:, -1]
        logits = z if sel is None else z.new_zeros(B, z.shape[-1]).index_copy_(0, sel, z)
        nxt = _reference_pick(logits, temperature, top_p, greedy, generator)
        if on_step is not None:
            on_step(logits, nxt)
        picked = nxt.tolist()
        for i in live:
            gen[i].append(picked[i])
        live = [i for i in live if not ends(gen[i])]
        if not live:
            break
        cache = out.past_key_values
        if len(live) <= len(rows) * SHRINK_AT and _prunable(cache):
            alive = set(live)
            keep = torch.tensor([j for j, r in enumerate(rows) if r in alive], device=device)
            cache.batch_select_indices(keep)
            rows, pos = live, pos[keep]
            sel = torch.tensor(rows, device=device)
        pos = pos + 1
        out = model(
            input_ids=(nxt if sel is None else nxt[sel])[:, None],
            attention_mask=attn[:, : L + s + 1] if sel is None else attn[sel, : L + s + 1],
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
        )
    return gen


CASES = {
    "t1": dict(temperature=1.0, max_new_tokens=12),
    "t1_capped": dict(temperature=1.0, max_new_tokens=5),
    "t07_top_p": dict(temperature=0.7, top_p=0.9, max_new_tokens=12),
    "greedy": dict(greedy=True, max_new_tokens=12),
    "tool_loop": dict(temperature=2.0, env=_OnHash(), max_turns=2, max_new_tokens=20),
}


def _sample(model, generate, seed, kw, monkeypatch):
    """(trajectories, the generator's final state, every probability tensor the sampler drew from)."""
    draws, multinomial = [], torch.multinomial

    def spy(probs, *a, **k):
        draws.append(probs.clone())
        return multinomial(probs, *a, **k)

    monkeypatch.setattr(rollout_mod, "generate", generate)
    monkeypatch.setattr(torch, "multinomial", spy)
    g = torch.Generator().manual_seed(seed)
    prompts = ["1>", "23>", "456>", "7>", "8>", "9>"] * 2
    trajs = rollout(model, TOK, prompts, generator=g, stats_k=None if kw.get("greedy") else 4, **kw)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    return trajs, g.get_state(), draws


@pytest.mark.parametrize("ending", [False, True], ids=["random_model", "rows_end_early"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_decode_loop_samples_exactly_what_the_reference_samples(case, ending, seed, monkeypatch):
    kw = CASES[case]
    model = _ending_model()[0] if ending else _model().eval()
    old, old_rng, old_p = _sample(model, _reference_generate, seed, kw, monkeypatch)
    new, new_rng, new_p = _sample(model, generate, seed, kw, monkeypatch)
    assert torch.equal(new_rng, old_rng)  # the same random draws ...
    assert len(new_p) == len(old_p) and all(torch.equal(a, b) for a, b in zip(old_p, new_p))  # ... from the same p
    if ending:
        assert len({len(t.response_ids) for t in old}) > 2  # rows finished at different steps
    if case == "t1_capped":
        assert any(t.capped for t in old)  # rows cut at max_new_tokens: the loop's last step
    for a, b in zip(old, new):
        same = ("response_ids", "response_mask", "turns", "capped")
        assert [getattr(b, f) for f in same] == [getattr(a, f) for f in same]
        assert b.text == a.text == TOK.decode(a.response_ids, skip_special_tokens=True)
        if kw.get("greedy"):
            assert a.stats is None and b.stats is None
            continue
        for f in ("logp", "lse", "logits_k", "indices", "entropy"):
            assert torch.equal(getattr(b.stats, f), getattr(a.stats, f)), f
