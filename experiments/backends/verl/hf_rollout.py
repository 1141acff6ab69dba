"""A rollout engine for verl that generates with Hugging Face transformers (rollout name "hf").

verl 0.9.1's rollouts (vLLM, SGLang, TensorRT-LLM) are GPU-only; this one lets verl's real training loop
run on CPU, for development and for rehearsing a GPU run (``emapg rehearse``). ``HFReplica`` launches one
``HFGenerationServer`` actor per replica (token-in/token-out ``generate`` for verl's agent loops; requests
waiting together run as one left-padded ``generate`` per sampling setting) and ``HFServerAdapter``, in each
training worker, loads the trainer's weight syncs into it. Log-probs are vLLM's default "processed" ones:
after the request's logits processors. Speed is not a goal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, StoppingCriteria, StoppingCriteriaList
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout import base, replica
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from experiments.backends.verl import attention

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"  # actor_rollout_ref.rollout.name


def register() -> None:
    """Add the engine to verl's two rollout registries (idempotent; every process that resolves rollouts)."""
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"
    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFReplica)


def _server_name(replica_rank: int) -> str:
    return f"{ROLLOUT_NAME}_server_{replica_rank}_0"  # node 0: a replica's one server


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The settings a batch shares (requests with equal ``Sampling`` run together)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    logprobs: bool = False

    @classmethod
    def from_params(cls, params: dict[str, Any], default_max_tokens: int) -> Sampling:
        """verl's sampling_params dict (vLLM names) -> Sampling; settings this engine cannot honour are refused."""
        p = dict(params)
        max_tokens = p.pop("max_tokens", p.pop("max_new_tokens", None))
        stop = p.pop("stop", None) or ()
        out = cls(
            max_tokens=int(default_max_tokens if max_tokens is None else max_tokens),
            temperature=float(p.pop("temperature", 1.0)),
            top_p=float(p.pop("top_p", 1.0)),
            top_k=int(p.pop("top_k", -1) or -1),
            stop=tuple(sorted([stop] if isinstance(stop, str) else stop)),
            ignore_eos=bool(p.pop("ignore_eos", False)),
            repetition_penalty=float(p.pop("repetition_penalty", 1.0) or 1.0),
            logprobs=bool(p.pop("logprobs", False)),
        )
        p.pop("seed", None)  # sampling is seeded per server (rollout.seed + replica rank)
        for key in ("skip_special_tokens", "include_stop_str_in_output", "n", "detokenize"):
            p.pop(key, None)  # text-side or n=1 options: no effect on the returned token ids
        if p:
            raise ValueError(f"the hf rollout engine does not support sampling params {sorted(p)}")
        return out


def cut(tokens: list[int], eos_ids: set[int], stops: tuple[str, ...], decode, ignore_eos: bool = False) -> int:
    """Number of leading `tokens` to keep: through the first eos (unless `ignore_eos`) or through the
    token that completes the first stop string, whichever comes first; all of them otherwise."""
    end = len(tokens)
    if not ignore_eos:
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), end)
    if stops:
        for i in range(end):  # the token whose text first contains a stop string ends the turn
            text = decode(tokens[: i + 1])
            if any(s in text for s in stops):
                return i + 1
    return end


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    sampling: Sampling
    future: asyncio.Future


class HFGenerationServer:
    """Token-in/token-out generation with an HF causal LM; the methods verl calls on a rollout server."""

    def __init__(self, config, model_config, replica_rank: int = 0):
        self.config = omega_conf_to_dataclass(config)
        path = getattr(model_config, "local_path", None) or model_config.path
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=bool(model_config.trust_remote_code))
        attn = (dict(model_config.override_config or {})).get("attn_implementation", "sdpa")
        attn = "sdpa" if attn in ("flash_attention_2", attention.NAME) else attn  # generation: a cache and masks
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))

        # generate() fills every unset option from the model's generation config (e.g. top_k=20, its eos):
        # an empty one makes each request's settings the only ones that apply
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=None)
        torch.manual_seed(int(self.config.seed) + replica_rank)  # this actor's process samples with the global RNG
        self.global_steps: int | None = None
        self._pending: list[_Request] = []
        self._busy = asyncio.Lock()
        self.replica_rank = replica_rank

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict, request_id: str, image_data=None, video_data=None, **kwargs
    ):
        """One request; returns verl's TokenOutput. Requests that arrive together are generated as one batch."""
        if image_data is not None or video_data is not None:
            raise NotImplementedError("the hf rollout engine is text-only")
        prompt_ids, c = [int(t) for t in prompt_ids], self.config
        limit = (c.max_model_len or (c.prompt_length + c.response_length)) - len(prompt_ids)
        if limit < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate (max_model_len)")
        default_max = min(c.response_length, c.prompt_length + c.response_length - len(prompt_ids))
        sampling = Sampling.from_params(sampling_params, default_max)
        sampling = dataclasses.replace(sampling, max_tokens=max(1, min(sampling.max_tokens, limit)))
        request = _Request(prompt_ids, sampling, asyncio.get_running_loop().create_future())
        self._pending.append(request)
        await asyncio.sleep(0)  # requests sent together (verl's agent loops gather them) join this batch
        async with self._busy:
            if not request.future.done():
                batch, self._pending = self._pending, []
                try:
                    results = await asyncio.to_thread(self._generate_batch, batch)
                except BaseException as e:  # every waiting request fails with the cause
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(e)
                else:
                    for r, res in zip(batch, results):
                        r.future.set_result(res)
        token_ids, log_probs = await request.future
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _generate_batch(self, batch: list[_Request]) -> list[tuple[list[int], list[float] | None]]:
        groups: dict[Sampling, list[int]] = {}
        for i, r in enumerate(batch):
            groups.setdefault(r.sampling, []).append(i)
        out: list = [None] * len(batch)
        for sampling, rows in groups.items():
            for i, res in zip(rows, self._generate_group([batch[i].prompt_ids for i in rows], sampling)):
                out[i] = res
        return out

    @torch.no_grad()
    def _generate_group(self, prompts: list[list[int]], s: Sampling) -> list[tuple[list[int], list[float] | None]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, P) left-padded
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        greedy = s.temperature <= 0
        gen = GenerationConfig(
            max_new_tokens=s.max_tokens,
            do_sample=not greedy,
            temperature=None if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=0 if greedy or s.top_k <= 0 else s.top_k,  # 0: no top-k
            repetition_penalty=s.repetition_penalty,
            pad_token_id=self.pad_id,
            eos_token_id=None if s.ignore_eos else sorted(self.eos_ids),
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=True,
        )
        criteria = StoppingCriteriaList([_StopStrings(self.tokenizer, s.stop, width)] if s.stop else [])
        res = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=gen,
            stopping_criteria=criteria,
        )
        new = res.sequences[:, width:].cpu()  # (B, L)
        # scores: the logits after the request's processors (penalty, temperature, top-k/top-p masking), so
        # these are vLLM's default "processed" log-probs; one step at a time, never (B, L, V) at once
        steps = [
            torch.log_softmax(x.float(), -1).gather(-1, new[:, t, None].to(x.device))[:, 0].cpu()  # (B,)
            for t, x in enumerate(res.scores)
        ]
        chosen = torch.stack(steps, dim=1)  # (B, L)
        results = []
        for i in range(len(prompts)):
            row = new[i].tolist()
            n = cut(row, self.eos_ids, s.stop, self.tokenizer.decode, s.ignore_eos)
            results.append((row[:n], chosen[i, :n].tolist() if s.logprobs else None))
        return results

    def update_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Copy the trainer's tensors into the model; every name must be one of its parameters or buffers."""
        own = self.model.state_dict(keep_vars=True)  # includes tied weights (lm_head.weight) under their own names
        unknown = sorted(set(named_tensors) - set(own))
        if unknown:
            raise KeyError(f"weight sync: {len(unknown)} tensors the rollout model does not have, e.g. {unknown[:3]}")
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                own[name].copy_(tensor.to(own[name].dtype))
        if global_steps is not None:
            self.global_steps = global_steps
        return len(named_tensors)

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    # ------------------------------------------------------------------ lifecycle (nothing to free on CPU)
    async def _nothing(self, *args, **kwargs):
        return None

    # HF generate keeps no KV cache between requests, and no profiler runs
    wake_up = sleep = clear_kv_cache = release_kv_cache = resume_kv_cache = resume_generation = _nothing
    start_profile = stop_profile = _nothing

    async def wait_for_requests_to_drain(self):
        async with self._busy:
            return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        return {"aborted_count": 0, "request_ids": []}  # requests finish; nothing is partial

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True):
        return {"aborted": False, "request_id": request_id}

    def get_server_address(self) -> tuple[str, int]:
        return "127.0.0.1", 0  # token-in/token-out through the Ray handle only; no HTTP endpoint


class _StopStrings(StoppingCriteria):
    """A transformers stopping criterion: (B,) bool, True for rows whose new text contains a stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...], prompt_width: int):
        self.tokenizer, self.stops, self.prompt_width = tokenizer, stops, prompt_width
        self.window = 4 * max(len(s) for s in stops) + 4  # tokens: a byte-level token holds >= 1/4 character

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        tails = input_ids[:, self.prompt_width :][:, -self.window :].tolist()
        done = [any(s in self.tokenizer.decode(t) for s in self.stops) for t in tails]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class HFReplica(RolloutReplica):
    """One ``HFGenerationServer`` per replica, on the node of the replica's first training worker."""

    async def launch_servers(self):
        if self.nnodes != 1:
            raise ValueError(
                "the hf rollout engine runs one server per replica on one node "
                f"(rollout tensor_model_parallel_size spans {self.nnodes} nodes)"
            )
        options = {"name": _server_name(self.replica_rank), "num_cpus": 0, "max_concurrency": self.max_concurrency}
        if self.workers:
            node = await self.workers[0].__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        server = (
            ray.remote(HFGenerationServer)
            .options(**options)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.get_server_address.remote()  # raises here if the model cannot be loaded
        self.servers = [server]
        self._server_handle = server
        self._server_address = _server_name(self.replica_rank)

    async def sleep(self):
        return None


class HFServerAdapter(BaseRollout):
    """In each training worker: the trainer's weight syncs go to this replica's server (rank 0 sends)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        world *= self.config.pipeline_model_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self._has_server = rank % world == 0
        self._server = None

    def _handle(self):
        if self._server is None:
            self._server = ray.get_actor(_server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    @torch.no_grad()
    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", peft_config=None, **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout engine takes full tensors (wire_format={wire_format!r})")
        if peft_config is not None:
            raise NotImplementedError("the hf rollout engine does not take LoRA adapters")
        named = {}
        async for name, tensor in ensure_async_iterator(weights):  # every rank iterates (collectives inside)
            if self._has_server:
                named[name] = tensor.detach().to("cpu", copy=True)
        if self._has_server:
            await self._handle().update_weights.remote(named, global_steps)
