"""The Search-R1 tool protocol as a verl 0.9.1 agent loop (agent name ``search_r1``).

verl's stock ``tool_agent`` speaks hermes JSON tool calls; the paper's search task uses Search-R1's
tags (experiments/tasks/search.py). Per trajectory, up to max_turns searches then one answer turn:

    responses:     | turn 1 (model) | <information> (env) | turn 2 (model) | ... |   <= response_length
    response_mask: | 1 1 ... 1 1    | 0 0 ... 0 0         | 1 1 ... 1 1    | ... |

A turn generates at most ``custom.max_turn_tokens`` with stop string "</search>"; a response ending in a
search gets the retriever's information block (mask 0, logprob 0.0). Registered through
experiments/conf/verl/agent_loops.yaml; settings from verl's rollout config (``multi_turn.*``,
``custom.retriever_url``, ``custom.max_turn_tokens``: ``launch._multi_turn_keys``).

Stop string and returned tokens (read from verl's source, not run on GPUs): verl passes ``stop`` to vLLM
(vllm_async_server.py:634, detokenizing: ``skip_tokenizer_init: False`` at :328) and SGLang
(async_sglang_server.py:627) and returns the engine's token ids as they are (vllm_async_server.py:710,
async_sglang_server.py:662/678). A stop string trims only the engine's text, so the ids end with the tokens
that spell ``</search>``: model samples, kept with mask 1 and their logprobs. SGLang runs with verl's
``skip_tokenizer_init: True`` (rollout.yaml:333) and cannot match strings, so a turn is cut right after the
first token that completes ``</search>`` (on vLLM the cut removes nothing); a prefix of a sample is a sample.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.utils.profiler import simple_timer
from verl.utils.rollout_trace import rollout_trace_op
from verl.workers.rollout.replica import TokenOutput

from experiments.tasks import search

logger = logging.getLogger(__file__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

NAME = "search_r1"  # in experiments/conf/verl/agent_loops.yaml
RETRIEVER_KEY, TURN_TOKENS_KEY = "retriever_url", "max_turn_tokens"  # under actor_rollout_ref.rollout.custom


@functools.cache
def retriever(url: str):
    """One HTTP client per retriever URL and process (the loop is instantiated once per trajectory)."""
    return search.make_env(retriever_url=url)


def cut_after_stop(tokenizer, token_ids: list[int], stop: str = search.STOP) -> int:
    """Number of leading tokens up to the one completing the first `stop` (len(token_ids) if none); what
    follows, an EOS included, is dropped, as vLLM ends the turn there."""
    decode = lambda n: tokenizer.decode(token_ids[:n])  # noqa: E731
    if stop not in decode(len(token_ids)):
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # invariant: stop in decode(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stop in decode(mid) else (mid + 1, hi)
    return hi


class SearchR1AgentLoop(AgentLoopBase):
    """Search-R1's `<search>` / `<information>` protocol over verl's token-in-token-out server."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mt = self.rollout_config.multi_turn
        self.response_length: int = self.rollout_config.response_length
        self.max_turns: int = mt.max_assistant_turns - 1 if mt.max_assistant_turns else search.MAX_TURNS
        self.max_info_tokens: int = mt.max_tool_response_length
        custom = self.rollout_config.get("custom") or {}
        self.max_turn_tokens: int = int(custom.get(TURN_TOKENS_KEY) or self.response_length)
        if self.max_turn_tokens < 1:
            raise ValueError(
                f"actor_rollout_ref.rollout.custom.{TURN_TOKENS_KEY} must be >= 1; got {self.max_turn_tokens}"
            )
        url = custom.get(RETRIEVER_KEY)
        if not url:
            raise ValueError(
                f"the {NAME} agent loop needs a retriever: set backend.verl.retriever_url (an "
                f"`emapg retriever serve` URL; verl key actor_rollout_ref.rollout.custom.{RETRIEVER_KEY})"
            )
        self.env = retriever(url)

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> AgentLoopOutput:
        """One trajectory of `raw_prompt` (a text-only chat); see the module docstring for the turns."""
        messages = list(kwargs["raw_prompt"])
        if await self.process_multi_modal_info(messages):
            raise ValueError(f"the {NAME} agent loop is text-only; this prompt carries images, videos or audio")
        prompt_ids = await self.ct_build_initial_tokens(messages)  # (P,)
        request_id = f"det-{int(priority)}" if self.rollout_config.get("full_determinism", False) else uuid4().hex
        ids, mask = list(prompt_ids), []  # ids: prompt + response so far; mask: (R,) per response token
        logprobs: list[float] | None = [] if sampling_params.get("logprobs") else None
        metrics, extra, turns, searches = {}, {}, 0, 0
        while len(mask) < self.response_length:
            final = searches >= self.max_turns  # the answer turn: no stop string, no tool response
            out = await self._generate(request_id, ids, sampling_params, final=final, used=len(mask), metrics=metrics)
            turns += 1
            extra = self._merge_extra(extra, out.extra_fields)
            keep = len(out.token_ids) if final else cut_after_stop(self.tokenizer, out.token_ids)
            merged, mask, logprobs = await self.ct_merge_assistant_token(
                ids,
                out.token_ids[:keep],
                mask,
                logprobs,
                assistant_logprobs=(out.log_probs or [])[:keep] if logprobs is not None else None,
            )
            ids = merged.token_ids
            if final or out.stop_reason == "aborted" or self._ends_with_eos(out.token_ids[:keep]):
                break
            info = await self._information(ids[len(ids) - len(mask) :], metrics)
            if info is None:
                break
            ids, searches = ids + info, searches + 1
            mask = mask + [0] * len(info)
            logprobs = logprobs + [0.0] * len(info) if logprobs is not None else None
        return self._output(ids, mask, logprobs, num_turns=turns + searches + 1, metrics=metrics, extra=extra)

    async def _generate(
        self, request_id: str, ids: list[int], sampling_params: dict[str, Any], *, final: bool, used: int, metrics: dict
    ) -> TokenOutput:
        """One turn: at most max_turn_tokens and the remaining response budget; stops at `</search>` unless `final`."""
        params = {**sampling_params, "max_tokens": min(self.max_turn_tokens, self.response_length - used)}
        if not final:
            params["stop"] = sorted(set(params.get("stop") or []) | set(search.STOP_STRINGS))
        with simple_timer("generate_sequences", metrics):
            out: TokenOutput = await self.server_manager.generate(
                request_id=request_id, prompt_ids=ids, sampling_params=params
            )
        metrics["num_preempted"] = metrics.get("num_preempted", 0) + (out.num_preempted or 0)
        return out

    @staticmethod
    def _merge_extra(extra: dict, new: dict) -> dict:
        """The first turn's extra_fields, with the latest max_global_steps (as verl's tool_agent keeps them)."""
        if not extra:
            return dict(new)
        if "max_global_steps" in new:
            extra["max_global_steps"] = new["max_global_steps"]
        return extra

    def _ends_with_eos(self, token_ids: list[int]) -> bool:
        return bool(token_ids) and token_ids[-1] == self.tokenizer.eos_token_id

    async def _information(self, response_ids: list[int], metrics: dict) -> list[int] | None:
        """Token ids of the `<information>` block after a response ending in `</search>`, else None; at most
        ``multi_turn.max_tool_response_length`` tokens (verl's tool_agent counts characters)."""
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        with simple_timer("tool_calls", metrics):
            info = await self.loop.run_in_executor(None, search.tool_response, text, self.env)
        if info is None:
            return None
        return self.tokenizer(info, add_special_tokens=False)["input_ids"][: self.max_info_tokens]

    def _output(
        self, ids: list[int], mask: list[int], logprobs: list[float] | None, *, num_turns: int, metrics, extra
    ) -> AgentLoopOutput:
        """prompt_ids (P,) and response_ids / response_mask / response_logprobs cut to response_length."""
        n = self.response_length
        out = AgentLoopOutput(
            prompt_ids=ids[: len(ids) - len(mask)],
            response_ids=ids[len(ids) - len(mask) :][:n],
            response_mask=mask[:n],
            response_logprobs=logprobs[:n] if logprobs is not None else None,
            num_turns=num_turns,
            metrics=metrics,
            extra_fields=extra,
        )
        out.extra_fields.update({"turn_scores": [], "tool_rewards": []})  # the schema verl's tool_agent emits
        return out
