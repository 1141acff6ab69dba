"""Rollout for the local backend: batched sampling with a KV cache, stop strings, and the multi-turn tool
loop of Search-R1 (a turn stops at the tool's stop string, the environment appends an observation,
generation continues; after ``max_turns`` tool calls, one final turn).

Shapes: B sequences, L context length. Environment tokens are part of the context but carry mask 0, so
the PG and KL losses never see them (Search-R1's "state_masking").

With ``stats_k`` set, ``rollout`` also returns pi_old's per-token ``TokenStats`` (at the rollout
temperature, without top-p) from the logits the decode computes anyway: one (B, V) block per step, never
(B, T, V); environment tokens get zeros. All randomness comes from ``generator`` (checkpointed by the
trainer, on the model's device), so a resumed run samples exactly what an uninterrupted run samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from ema_pg_core.topk import TokenStats, token_stats_from_logits


class ToolEnv(Protocol):
    """The environment side of a tool task (e.g. search_tiny's retriever)."""

    stop: str  # a turn ends when the response ends with this string (e.g. '</search>')

    def respond(self, response_so_far: str) -> str | None:
        """Observation text to append (e.g. '<information>...</information>'), or None to stop."""


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # model and environment tokens, in order
    response_mask: list[int] = field(default_factory=list)  # 1 = sampled by the model, 0 = environment
    turns: int = 0  # tool calls answered
    text: str = ""  # decoded response (environment text included)
    capped: bool = False  # its last turn was cut at max_new_tokens (neither eos nor the stop string)
    stats: TokenStats | None = None  # sampling-time pi_old statistics, (R,) / (R, K) per response token


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(B, V) probabilities with the tail beyond cumulative mass top_p zeroed (renormalised)."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True, dim=-1)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # always keeps the most likely token
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def _pick(
    logits: torch.Tensor, temperature: float, top_p: float, greedy: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """(B,) next tokens from (B, V) logits: argmax when `greedy` or at temperature 0, else sampled."""
    if greedy or temperature == 0:
        return logits.argmax(-1)
    if not temperature > 0:  # logits / T < 0 would sample the inverted distribution
        raise ValueError(f"temperature must be >= 0 (0 = greedy); got {temperature!r}")
    z = logits.float()
    probs = torch.softmax(z if temperature == 1 else z / temperature, -1)  # z / 1 == z exactly: one op fewer
    return torch.multinomial(_top_p_filter(probs, top_p), 1, generator=generator)[:, 0]


StepHook = Callable[[torch.Tensor, torch.Tensor], None]
"""Called once per decoding step with the (B, V) logits and the (B,) tokens picked from them."""


def _stop_filter(stop: str | None, decode) -> Callable[[int], bool]:
    """token id -> "may this token complete ``stop``?", a cached necessary condition: the decoded tail can
    end with ``stop`` only if the newest token's text holds its last character when that is ASCII (one byte,
    of the newest token; a token decoding to nothing leaves the text as it was a step earlier)."""
    if not stop or not stop[-1].isascii():
        return lambda _tok: True
    cache: dict[int, bool] = {}

    def may_end(tok: int) -> bool:
        if tok not in cache:
            cache[tok] = stop[-1] in decode([tok])
        return cache[tok]

    return may_end


@torch.no_grad()
def generate(
    model,
    contexts: list[list[int]],
    *,
    max_new_tokens: int,
    pad_id: int,
    eos_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    stop: str | None = None,
    decode=None,
    on_step: StepHook | None = None,
) -> list[list[int]]:
    """Sample continuations for a batch of token contexts (left-padded, KV cache; temperature 0 = greedy).

    A sequence stops at eos or at ``stop`` (both included; ``decode``: ids -> text) or after
    ``max_new_tokens``. Finished rows leave the model's batch once the live ones are at most ``SHRINK_AT``
    of it; sampling still draws for all B rows (finished ones from zero logits), so the generator's stream,
    and hence every live row's token, does not depend on which rows are still in the model's batch.
    """
    B = len(contexts)
    device = next(model.parameters()).device  # everything below (inputs, KV cache, sampling) lives here
    out, attn, L = _prefill(model, contexts, pad_id, max_new_tokens, device)  # attn: (B, L + max_new_tokens)
    gen: list[list[int]] = [[] for _ in range(B)]
    live, ends = list(range(B)), _ender(eos_id, stop, decode)
    rows, sel = list(range(B)), None  # the batch row of each of the model's b rows; sel: rows as a tensor
    pos = attn[:, :L].sum(-1, keepdim=True) - 1  # (b, 1) position of each row's last token
    for s in range(max_new_tokens):
        z = out.logits[:, -1]  # (b, V)
        logits = z if sel is None else z.new_zeros(B, z.shape[-1]).index_copy_(0, sel, z)  # (B, V)
        nxt = _pick(logits, temperature, top_p, greedy, generator)  # (B,)
        if on_step is not None:
            on_step(logits, nxt)
        picked = nxt.tolist()  # one device -> host copy per step
        for i in live:
            gen[i].append(picked[i])
        live = [i for i in live if not ends(gen[i])]
        if not live or s == max_new_tokens - 1:  # no forward for a token that is never sampled
            break
        cache = out.past_key_values
        if len(live) <= len(rows) * SHRINK_AT and _prunable(cache):  # drop the finished rows from the model's batch
            alive = set(live)
            keep = torch.tensor([j for j, r in enumerate(rows) if r in alive], device=device)  # (b',) of the b rows
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


def _prefill(model, contexts: list[list[int]], pad_id: int, max_new_tokens: int, device):
    """(model output on the left-padded contexts, attention mask (B, L + max_new_tokens), L); the mask is
    allocated once for the whole generation: step s attends to the view attn[:, : L + s]."""
    L = max(len(c) for c in contexts)
    left = [L - len(c) for c in contexts]  # left padding per row
    ids = torch.tensor([[pad_id] * n + list(c) for n, c in zip(left, contexts)], dtype=torch.long, device=device)
    attn = torch.tensor([[0] * n + [1] * (L - n + max_new_tokens) for n in left], dtype=torch.long, device=device)
    pos = (attn[:, :L].cumsum(-1) - 1).clamp_min(0)  # (B, L)
    return model(input_ids=ids, attention_mask=attn[:, :L], position_ids=pos, use_cache=True), attn, L


def _ender(eos_id: int, stop: str | None, decode) -> Callable[[list[int]], bool]:
    """tokens so far -> has the sequence ended (its newest token is eos, or its decoded tail ends with stop)?"""
    tail, may_end = len(stop) if stop else 0, _stop_filter(stop, decode)
    return lambda g: g[-1] == eos_id or bool(stop and may_end(g[-1]) and decode(g[-tail:]).endswith(stop))


SHRINK_AT = 7 / 8  # generate drops finished rows once the live ones are at most this fraction of its batch (0: never)


def _prunable(cache) -> bool:
    """Can the KV cache drop batch rows? (transformers' per-layer key/value caches can; other kinds are left alone.)"""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(layer, DynamicLayer) for layer in layers)


STATS_BUFFER_BYTES = 64 * 2**20  # step logits the sampler buffers before computing their statistics at once


class _SamplerStats:
    """A StepHook keeping pi_old's statistics of every sampled token, computed in batches of steps."""

    def __init__(self, k: int, temperature: float):
        self.k, self.temperature, self.done, self.pending = k, temperature, [], []

    def __call__(self, logits: torch.Tensor, picked: torch.Tensor) -> None:  # (B, V), (B,)
        self.pending.append((logits, picked))
        if len(self.pending) * logits.numel() * 4 >= STATS_BUFFER_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            z = torch.stack([lg for lg, _ in self.pending], 1)  # (B, s, V)
            tok = torch.stack([t for _, t in self.pending], 1)  # (B, s)
            self.done.append(token_stats_from_logits(z, tok, k=self.k, temperature=self.temperature, entropy=True))
            self.pending = []

    def rows(self, lengths: list[int]) -> list[TokenStats]:
        """Row i's statistics for its first lengths[i] tokens: (n,) / (n, K)."""
        self._flush()
        cat = {f: torch.cat([getattr(st, f) for st in self.done], 1) for f in _FIELDS}  # (B, S) / (B, S, K)
        return [TokenStats(**{f: t[i, :n] for f, t in cat.items()}) for i, n in enumerate(lengths)]


_FIELDS = ("logp", "lse", "logits_k", "indices", "entropy")


def _zero_stats(n: int, like: TokenStats) -> TokenStats:
    """Statistics of n environment tokens (mask 0): zeros shaped like ``like``'s rows."""
    return TokenStats(**{f: getattr(like, f).new_zeros((n, *getattr(like, f).shape[1:])) for f in _FIELDS})


def _cat_stats(parts: list[TokenStats]) -> TokenStats:
    if len(parts) == 1:  # single-turn tasks
        return parts[0]
    return TokenStats(**{f: torch.cat([getattr(p, f) for p in parts]) for f in _FIELDS})


def _end_turn(tr: Trajectory, parts: list, new: list[int], stop, *, env, tokenizer, decode, max_new, max_obs) -> bool:
    """Append a turn's tokens to ``tr``, then the environment's observation when the turn ended at ``stop``;
    returns whether the trajectory continues (an observation was appended). ``parts``: its stats segments."""
    tr.response_ids += new
    tr.response_mask += [1] * len(new)
    text = decode(tr.response_ids) if stop else ""  # the last turn needs no text until the end
    stopped = (bool(new) and new[-1] == tokenizer.eos_token_id) or bool(stop and text.endswith(stop))
    tr.capped = len(new) >= max_new and not stopped  # a cut turn gets no observation: it is the last
    obs = env.respond(text) if (stop and text.endswith(stop)) else None
    if obs is None:
        return False
    obs_ids = tokenizer(obs, add_special_tokens=False)["input_ids"][:max_obs]
    tr.response_ids += obs_ids
    tr.response_mask += [0] * len(obs_ids)
    tr.turns += 1
    if parts:
        parts.append(_zero_stats(len(obs_ids), parts[-1]))
    return True


SKIP = {"skip_special_tokens": True}  # how responses are decoded, one at a time or all at the end


def rollout(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    env: ToolEnv | None = None,
    max_turns: int = 0,
    max_obs_tokens: int = 160,
    stats_k: int | None = None,
) -> list[Trajectory]:
    """One trajectory per prompt; without ``env``, a single generation turn.

    With ``env``: up to ``max_turns`` turns ending at ``env.stop`` get an observation appended (mask 0, cut
    to ``max_obs_tokens``), then one final turn without the stop string. ``stats_k`` (not None, sampling
    only): fill ``Trajectory.stats`` with the sampler's own top-``stats_k`` (0: no head) statistics.
    ``temperature`` 0 decodes greedily (as ``greedy``; no statistics then).
    """
    greedy = greedy or temperature == 0
    decode = lambda t: tokenizer.decode(t, **SKIP)  # noqa: E731
    trajs = [Trajectory(prompt_ids=ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    parts: list[list[TokenStats]] = [[] for _ in trajs]  # per trajectory: stats of its segments, in order
    active = list(range(len(trajs)))
    end_turn = partial(
        _end_turn, env=env, tokenizer=tokenizer, decode=decode, max_new=max_new_tokens, max_obs=max_obs_tokens
    )
    for turn in range(max_turns + 1 if env is not None else 1):
        stop = env.stop if (env is not None and turn < max_turns) else None
        ctx = [trajs[i].prompt_ids + trajs[i].response_ids for i in active]
        hook = None if stats_k is None or greedy else _SamplerStats(stats_k, temperature)
        outs = generate(
            model,
            ctx,
            max_new_tokens=max_new_tokens,
            pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id,
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
            generator=generator,
            stop=stop,
            decode=decode,
            on_step=hook,
        )
        for i, st in zip(active, hook.rows([len(o) for o in outs]) if hook else ()):
            parts[i].append(st)
        active = [i for i, new in zip(active, outs) if end_turn(trajs[i], parts[i], new, stop)]
        if not active:
            break
    for tr, ps, text in zip(trajs, parts, tokenizer.batch_decode([t.response_ids for t in trajs], **SKIP)):
        tr.text = text  # all trajectories' texts in one call
        tr.stats = _cat_stats(ps) if ps else None
    return trajs
