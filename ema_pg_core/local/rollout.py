"""Rollout for the local backend: batched sampling with a KV cache, stop strings, and the
multi-turn tool loop of Search-R1 (generation stops at the tool's stop string, the environment
appends an observation, generation continues; after ``max_turns`` tool calls one final turn).

Shapes: B sequences, L context length. Environment tokens are part of the context but carry
mask 0, so the PG and KL losses never see them (as Search-R1's "state_masking" does).

Determinism: all randomness comes from the ``generator`` argument (its state is checkpointed by
the trainer), so a resumed run samples exactly what an uninterrupted run samples. Inputs, KV cache
and sampling live on the model's device; the generator must be on that device too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class ToolEnv(Protocol):
    """The environment side of a tool task (e.g. search_tiny's retriever)."""

    stop: str
    """Generation of a turn stops when the response ends with this string (e.g. '</search>')."""

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
    """(B,) next tokens from (B, V) logits."""
    if greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    return torch.multinomial(_top_p_filter(probs, top_p), 1, generator=generator)[:, 0]


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
) -> list[list[int]]:
    """Sample continuations for a batch of token contexts (left-padded, KV cache).

    A sequence stops at eos (included), at ``stop`` (the decoded tail ends with it; included) or
    after ``max_new_tokens``. ``decode`` maps token ids to text (needed with ``stop``).
    """
    B = len(contexts)
    L = max(len(c) for c in contexts)
    device = next(model.parameters()).device  # everything below (inputs, KV cache, sampling) lives here
    left = [L - len(c) for c in contexts]  # left padding per row; ids and attn are (B, L)
    ids = torch.tensor([[pad_id] * n + list(c) for n, c in zip(left, contexts)], dtype=torch.long, device=device)
    attn = torch.tensor([[0] * n + [1] * len(c) for n, c in zip(left, contexts)], dtype=torch.long, device=device)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    gen: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    tail = len(stop) if stop else 0
    for _ in range(max_new_tokens):
        nxt = _pick(out.logits[:, -1], temperature, top_p, greedy, generator)  # (B,)
        picked = nxt.tolist()  # one device -> host copy per step
        for i in [i for i in range(B) if not done[i]]:
            gen[i].append(picked[i])
            if picked[i] == eos_id or (stop and decode(gen[i][-tail:]).endswith(stop)):
                done[i] = True
        if all(done):
            break
        step_attn = torch.ones(B, 1, dtype=torch.long, device=device)
        attn = torch.cat([attn, step_attn], 1)
        pos = pos[:, -1:] + 1
        out = model(
            input_ids=nxt[:, None],
            attention_mask=attn,
            position_ids=pos,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return gen


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
) -> list[Trajectory]:
    """One trajectory per prompt. Without ``env`` it is a single generation turn.

    With ``env``: up to ``max_turns`` turns ending at ``env.stop`` get an observation appended
    (mask 0, truncated to ``max_obs_tokens``); then one final turn without the stop string.
    """
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    trajs = [Trajectory(prompt_ids=tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    active = list(range(len(trajs)))
    for turn in range(max_turns + 1 if env is not None else 1):
        stop = env.stop if (env is not None and turn < max_turns) else None
        ctx = [trajs[i].prompt_ids + trajs[i].response_ids for i in active]
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
        )
        still = []
        for i, new in zip(active, outs):
            tr = trajs[i]
            tr.response_ids += new
            tr.response_mask += [1] * len(new)
            text = decode(tr.response_ids)
            stopped = (bool(new) and new[-1] == tokenizer.eos_token_id) or bool(stop and text.endswith(stop))
            tr.capped = len(new) >= max_new_tokens and not stopped  # a cut turn gets no observation: it is the last
            obs = env.respond(text) if (stop and text.endswith(stop)) else None
            if obs is not None:
                obs_ids = tokenizer(obs, add_special_tokens=False)["input_ids"][:max_obs_tokens]
                tr.response_ids += obs_ids
                tr.response_mask += [0] * len(obs_ids)
                tr.turns += 1
                still.append(i)
        active = still
        if not active:
            break
    for tr in trajs:
        tr.text = decode(tr.response_ids)
    return trajs
