"""``emapg rehearse``: a GPU preset's real verl loop, run on CPU (or one GPU) in minutes, before booking GPUs.

    emapg rehearse experiment=math_deepscaler_ema_pg [overrides ...] [--steps 3] [--out DIR] [--device cuda]
    emapg rehearse sweeps/search_r1_ema_pg.yaml                      # through Ray Tune: rehearse.sweep

The target's settings are kept but for what needs a GPU or a download (``rehearsal_settings``); the run is killed
once the checkpoint of step 2 is on disk, resumed to ``steps`` and its run directory checked (``CHECKS``); a failure
ends with ``FAILED: <what>; logs: <dir>`` (``failed_line``). What it checks, proves and cannot prove, and why no wait
has a wall-clock limit: docs/scaling-out.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml
from torch.nn.utils.rnn import pad_sequence

from ema_pg_core.config import KLConfig
from ema_pg_core.local.tiny import build_model as tiny_model
from ema_pg_core.local.tiny import build_tokenizer
from ema_pg_core.overrides import hydra_value
from ema_pg_core.telemetry import PROBE_KEYS
from experiments import build, tasks
from experiments.backends.verl import require_verl
from experiments.backends.verl.config import uses_topk
from experiments.ops.retrieval.service import HTTPRetriever
from experiments.records import read_evals, read_jsonl, read_metrics, read_wandb_state
from experiments.tasks import RehearsalData, get_task
from experiments.verl_metrics import FILE, attempt_files, trained_step

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# verl's dataset applies a chat template to every prompt: a minimal one over the tiny tokenizer's characters
KILL_AFTER = 2  # the first attempt is killed once the checkpoint of this step is complete
ANCHOR_PERIOD = 2  # of a rehearsal (tau < 1): updates after steps 2, 4, ...
ROWS = {"train": 16, "test": 2}  # generated rows: training prompts, and per benchmark / test source
PROBE_PROMPTS = 2  # trainer.probe_size of a rehearsal whose target runs the KL probe (then scored every step)
VLLM_MEMORY = 0.2  # backend.verl.gpu_memory_utilization of --device cuda (why not a preset's 0.85: docs/scaling-out.md)
STEP_TIMEOUT_S = 7200  # backend.verl.step_timeout_s: stops a run that prints but never steps (ATTEMPT_STALL_S: a hang)


# ---------------------------------------- The tiny model
def build_model(
    out_dir: Path, sft_texts: list[tuple[str, str]], steps: int = 300, seed: int = 0, heads: int = 4
) -> str:
    """A tiny Qwen2 (hidden size 64) + char-level tokenizer with ``CHAT_TEMPLATE``, given `steps` of SFT on (prompt,
    response) pairs (loss on the response and EOS only); saved with ``save_pretrained``. Returns the directory."""
    if (out_dir / "config.json").is_file():
        return str(out_dir)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = tiny_model(tok, hidden=64, layers=2, heads=heads, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pairs = [_encode(tok, p, r) for p, r in sft_texts]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = [pairs[int(i)] for i in torch.randint(len(pairs), (8,), generator=g)]
        ids = pad_sequence([torch.tensor(x) for x, _ in batch], batch_first=True, padding_value=tok.pad_token_id)
        labels = pad_sequence([torch.tensor(y) for _, y in batch], batch_first=True, padding_value=-100)  # (B, L)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out_dir)
    return str(out_dir)


def _encode(tok, prompt: str, response: str) -> tuple[list[int], list[int]]:
    p = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    p_ids, r_ids = tok(p)["input_ids"], tok(response)["input_ids"] + [tok.eos_token_id]
    return p_ids + r_ids, [-100] * len(p_ids) + r_ids


# ---------------------------------------- The rehearsal config
def rehearsal_settings(
    cfg, model_path: str, data: RehearsalData, steps: int, *, retriever_url: str | None = None, device: str = "cpu"
) -> dict[str, Any]:
    """{dotted key: value} that make `cfg` a rehearsal on `device` (see the module docstring), but for where it
    writes (the run directory and verl's checkpoints in it: ``rehearsal_overrides``, or the sweep's trial)."""
    sizes = get_task(str(cfg.task.name)).REHEARSAL
    settings = {
        "model.path": model_path,
        "logger.mode": "offline",  # W&B as the target logs it, offline (into the run directory; WANDB_MODE too)
        "trainer.device": device,
        "backend.verl.rollout_engine": "hf" if device == "cpu" else "vllm",  # hf_rollout.py runs on CPU only
        "backend.verl.nnodes": 1,
        "backend.verl.n_gpus_per_node": 1,
        "backend.verl.train_files": data.files["train"],
        "backend.verl.val_files": data.files.get("val", data.files["test"]),
        "backend.verl.max_prompt_length": sizes.prompt_tokens,
        "backend.verl.param_offload": False,
        "backend.verl.optimizer_offload": False,
        "backend.verl.max_token_len_per_gpu": 4096,
        "backend.verl.micro_batch_size_per_gpu": 4,
        "trainer.iterations": steps,
        "trainer.save_every": 1,
        "trainer.keep_checkpoints": 2,
        "backend.verl.step_timeout_s": STEP_TIMEOUT_S,
        "trainer.eval_every": steps,
        "trainer.eval_n": 1,
        "trainer.mini_batches": 2 if int(cfg.trainer.mini_batches) > 1 else 1,
        "rollout.prompts_per_iter": 4,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": sizes.turn_tokens,
    }
    if device == "cuda":  # one GPU: offloading stays as the target has it (a GPU feature), vLLM on one rank
        del settings["backend.verl.param_offload"], settings["backend.verl.optimizer_offload"]
        settings.update({"backend.verl.tensor_parallel_size": 1, "backend.verl.gpu_memory_utilization": VLLM_MEMORY})
    if float(cfg.algo.anchor.tau) < 1.0:
        settings["algo.anchor.period"] = ANCHOR_PERIOD
    if cfg.trainer.probe_every != 0:  # the target's probe (null: the default cadence), every step
        settings.update({"trainer.probe_every": 1, "trainer.probe_size": PROBE_PROMPTS})
    if cfg.backend.verl.multi_turn:
        settings["rollout.max_turns"] = sizes.max_turns
        settings["backend.verl.max_response_length"] = sizes.response_tokens or sizes.turn_tokens
        settings["backend.verl.max_tool_response_length"] = sizes.tool_response_tokens
        settings["backend.verl.retriever_url"] = retriever_url
    else:
        settings["backend.verl.max_response_length"] = sizes.turn_tokens
    infra = [
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "data.dataloader_num_workers=0",
    ]
    settings["backend.verl.overrides"] = list(cfg.backend.verl.overrides) + infra
    return settings


def rehearsal_overrides(
    cfg,
    model_path: str,
    data: RehearsalData,
    run_dir: Path,
    steps: int,
    *,
    retriever_url: str | None = None,
    device: str = "cpu",
) -> list[str]:
    """Hydra overrides (appended to the target's) that make `cfg` a rehearsal on `device` writing to `run_dir`."""
    settings = {"run_dir": str(run_dir), "backend.verl.checkpoint_dir": str(run_dir / "checkpoints")}
    settings.update(rehearsal_settings(cfg, model_path, data, steps, retriever_url=retriever_url, device=device))
    return [f"{key}={hydra_value(value)}" for key, value in settings.items()]


# ---------------------------------------- Running: attempt 1 (killed after step KILL_AFTER's checkpoint), attempt 2
ATTEMPT_STALL_S = 1800.0  # an attempt with no new step, checkpoint or output for this long is stopped: it failed


@dataclass
class Attempt:
    returncode: int | None  # None when it was killed (at its kill point, or stalled)
    killed_at: int | None  # the last complete checkpoint when the attempt was killed
    seconds: float
    log: Path
    timed_out: bool = False  # stopped after `timeout_s` without progress


def _trained(rows: list[dict]) -> list[int]:
    """The steps of verl metric lines that hold training metrics, in order."""
    return sorted(int(r["step"]) for r in rows if trained_step(r.get("data", {})))


def logged_step(run_dir: Path) -> int:
    """The last step this attempt's verl metrics file has training metrics for (0: none)."""
    return max([0, *_trained(read_jsonl(run_dir / FILE))])  # a line being written is dropped


def latest_checkpoint(run_dir: Path) -> int:
    """verl's latest complete checkpoint step (its tracker file), 0 when none."""
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def run_attempt(
    overrides: list[str], run_dir: Path, log: Path, *, kill_after: int | None, timeout_s: float = ATTEMPT_STALL_S
) -> Attempt:
    """``emapg train <overrides>`` in its own process group, its stdout and stderr to `log`; with `kill_after`,
    SIGKILL the whole group (driver, Ray, workers) once the checkpoint of that step is complete and its metrics are
    logged (verl writes them after the checkpoint). Stopped (``timed_out``) after `timeout_s` with no new step logged,
    no new checkpoint and no output: progress, not a wall clock, decides, so a loaded machine only makes it slower."""
    env = child_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # Ray binds 127.0.0.1: nothing leaves the machine
    cmd = [sys.executable, "-m", "experiments.cli", "train", *overrides]
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed, timed_out, seen, since = None, False, None, t0
        try:
            while proc.poll() is None:
                now = (latest_checkpoint(run_dir), logged_step(run_dir))
                if kill_after is not None and min(now) >= kill_after:
                    killed = now[0]
                    break
                if (now, log.stat().st_size) != seen:  # a new step or checkpoint, or output (verl starting up)
                    seen, since = (now, log.stat().st_size), time.time()
                elif time.time() - since > timeout_s:
                    timed_out = True
                    break
                time.sleep(1.0)
        finally:
            kill_group(proc)  # also what outlives the driver in its group (Ray's processes after a crash)
    code = None if killed is not None or timed_out else proc.returncode
    return Attempt(code, killed, time.time() - t0, log, timed_out)


NOT_INHERITED = ("RAY_ADDRESS", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")  # its own Ray; trainer.device decides


def child_env(**extra: str) -> dict[str, str]:
    """A rehearsal's `emapg` child's environment: W&B offline (the W&B check reads the offline runs), no bars."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    env.update(EMAPG_PROGRESS="0", PYTHONUNBUFFERED="1", WANDB_MODE="offline", **extra)
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of `proc`'s group (it was started as a session leader), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty
        pass
    proc.wait()


# ---------------------------------------- Checks: one line each, from the run directory alone
@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"  [{'ok' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


@dataclass(frozen=True)
class Expect:
    """What a rehearsal of one configuration must show."""

    steps: int
    tau: float
    period: int
    topk: bool
    k: int
    keep: int
    killed_at: int | None
    probe: bool = False
    attempts: int = 2  # verl attempts the run had at least (one offline W&B run each)


def _metrics(run_dir: Path) -> dict[int, dict]:
    return {int(r["iteration"]): r for r in read_metrics(run_dir) if int(r["iteration"]) > 0}


def _raw_attempts(run_dir: Path) -> list[list[dict]]:
    """verl's own metric lines, one list per attempt, oldest first (a line cut by a kill dropped)."""
    return [read_jsonl(path) for path in attempt_files(run_dir)]


def attempt_steps(run_dir: Path) -> list[list[int]]:
    """The steps each verl attempt trained, oldest attempt first."""
    return [_trained(rows) for rows in _raw_attempts(run_dir)]


def anchor_updates(run_dir: Path, step: int) -> int | None:
    """The EMA anchor's update count in the checkpoint of `step` (None: no anchor there)."""
    meta = run_dir / "checkpoints" / f"global_step_{step}" / "anchor" / "emapg_anchor.json"
    return json.loads(meta.read_text())["num_updates"] if meta.is_file() else None


def expect(run_dir: Path, killed_at: int | None = None, attempts: int = 2) -> Expect:
    """What the rehearsal of the run in `run_dir` must show, from its recorded config."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    tau, kl = float(cfg["algo"]["anchor"]["tau"]), cfg["algo"]["kl"]
    return Expect(
        steps=int(cfg["trainer"]["iterations"]),
        tau=tau,
        period=ANCHOR_PERIOD if tau < 1 else int(cfg["algo"]["anchor"]["period"]),
        topk=uses_topk(KLConfig(**kl)),
        k=int(kl["k"]),
        keep=int(cfg["trainer"]["keep_checkpoints"]),
        killed_at=killed_at,
        probe=cfg["trainer"]["probe_every"] != 0,
        attempts=attempts,
    )


def check_steps(run_dir: Path, e: Expect) -> Check:
    steps = sorted(_metrics(run_dir))
    want = list(range(1, e.steps + 1))
    return Check("steps recorded", steps == want, f"run record has steps {steps}, expected {want}")


def check_anchor_schedule(run_dir: Path, e: Expect) -> Check:
    m = _metrics(run_dir)
    updated = [s for s, r in sorted(m.items()) if r.get("anchor/updated") == 1.0]
    want = [s for s in range(1, e.steps + 1) if e.tau < 1.0 and s % e.period == 0]
    drift = [round(float(m[s].get("anchor/drift", 0.0)), 6) for s in updated]
    detail = f"updated at steps {updated}, scheduled {want} (tau={e.tau}, period={e.period}); drift at updates {drift}"
    return Check("anchor schedule", updated == want, detail)


def check_topk(run_dir: Path, e: Expect) -> Check:
    data = [row.get("data", {}) for rows in _raw_attempts(run_dir) for row in rows]
    keys = {k for d in data for k in d if "topk_k" in k}
    ks = sorted({d[k] for d in data for k in keys if k in d})
    if not e.topk:
        unneeded = f"computed although the estimator does not need them: {sorted(keys)}"
        return Check("Top-k statistics", not keys, unneeded if keys else "estimator needs none; none computed")
    return Check("Top-k statistics", ks == [float(e.k)], f"head size seen in the actor loss {ks}, expected [{e.k}]")


def check_probe(run_dir: Path, e: Expect) -> Check:
    """The KL probe: finite kl/exact >= 0 and its estimate at every step, and the same probe tokens in every
    checkpoint, those written after the resume included (the resumed run scores the tokens it captured)."""
    from experiments.backends.verl.probe import PROBE_FILE  # loads verl, torch

    m = _metrics(run_dir)
    logged = [s for s, r in sorted(m.items()) if all(k in r for k in PROBE_KEYS)]
    if not e.probe:
        return Check("KL probe", not logged, f"the target runs none; scored at steps {logged} (expected none)")
    values = [(s, m[s]["kl/exact"], m[s]["kl/estimate_on_probe"]) for s in logged]
    sane = all(math.isfinite(x) and math.isfinite(y) and x >= -1e-6 for _, x, y in values)
    files = sorted((run_dir / "checkpoints").glob(f"global_step_*/{PROBE_FILE}"))
    tokens = [torch.load(f, weights_only=False)["data"]["input_ids"].values() for f in files]
    same = bool(tokens) and all(torch.equal(t, tokens[0]) for t in tokens)
    ok = logged == list(range(1, e.steps + 1)) and sane and same
    shown = ", ".join(f"{s}: {x:.3g} / {y:.3g}" for s, x, y in values)
    detail = f"kl/exact / estimate at steps {shown or 'none'}; {len(files)} checkpoints hold the probe"
    return Check("KL probe", ok, detail + (", the same tokens in each" if same else ", NOT the same tokens"))


def check_checkpoints(run_dir: Path, e: Expect) -> Check:
    root = run_dir / "checkpoints"
    steps = sorted(int(p.name.rsplit("_", 1)[1]) for p in root.glob("global_step_*") if p.is_dir())
    want = list(range(max(1, e.steps - e.keep + 1), e.steps + 1))
    missing = [s for s in steps if not (root / f"global_step_{s}" / "actor").is_dir()]
    if e.tau < 1.0:
        missing += [s for s in steps if not (root / f"global_step_{s}" / "anchor" / "emapg_anchor.json").is_file()]
    ok = steps == want and not missing
    done = f"; incomplete (actor/anchor missing) at {sorted(set(missing))}" if missing else "; actor + anchor each"
    return Check("checkpoints", ok, f"on disk {steps}, expected the last {e.keep}: {want}{done}")


def check_resume(run_dir: Path, e: Expect) -> Check:
    attempts = attempt_steps(run_dir)
    resumed = attempts[-1] if attempts else []
    ok = len(attempts) >= 2 and resumed[:1] == [e.killed_at + 1]
    detail = f"killed after the checkpoint of step {e.killed_at}; the resumed attempt trained steps {resumed}"
    if e.tau < 1.0:
        updates, want = anchor_updates(run_dir, e.steps), e.steps // e.period
        ok = ok and updates == want
        detail += f"; anchor updates at step {e.steps}: {updates} (scheduled {want}, counted across the kill)"
    return Check("resume", ok, detail)


def check_evals(run_dir: Path, e: Expect) -> Check:
    """Per-problem rows of the last step's validation for the policy and, evaluated with its own weights,
    the EMA anchor, and the anchor's metrics beside the policy's."""
    rows = [r for r in read_evals(run_dir) if r["iteration"] == e.steps]
    per = {m: sorted(r["problem_id"] for r in rows if r["model"] == m) for m in ("policy", "anchor")}
    anchor_keys = sorted(k for k in _metrics(run_dir).get(e.steps, {}) if k.startswith("eval_anchor/"))
    ok = bool(per["policy"]) and per["policy"] == per["anchor"] and bool(anchor_keys)
    detail = (
        f"step {e.steps}: {len(per['policy'])} policy and {len(per['anchor'])} anchor rows in evals.jsonl "
        f"(same problems: {per['policy'] == per['anchor']}); anchor metrics {anchor_keys}"
    )
    return Check("evaluation rows", ok, detail)


WANDB_HEADER = 7
"""Bytes of W&B's offline run file before its first record (its ":W&B" header). An attempt SIGKILLed seconds after
verl's tracker started W&B (a sweep rehearsal's driver kill) leaves just that: it has no group to name."""


def check_wandb(run_dir: Path, e: Expect) -> Check:
    """verl's tracker wrote an offline W&B run per attempt, all under the run's one id (kept in wandb_run.json),
    in the run's group; or none at all when the target's logger is none."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    lg, state = cfg.get("logger") or {}, read_wandb_state(run_dir)
    found = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    if lg.get("name") == "none":
        return Check("W&B", not found and not state, f"logger=none: {len(found)} W&B runs written (expected 0)")
    group = lg.get("group") or (cfg.get("sweep") or {}).get("name") or cfg.get("experiment")
    ids = sorted({p.parent.name.rsplit("-", 1)[1] for p in found})
    written = [p for p in found if p.stat().st_size > WANDB_HEADER]  # an attempt killed first wrote no record
    named = bool(written) and all(str(group).encode() in p.read_bytes() for p in written)  # its run record does
    ok = ids == [state.get("id")] and len(found) >= e.attempts and named and state.get("mode") == "offline"
    detail = f"{len(found)} offline runs (one per attempt) with ids {ids}, wandb_run.json id {state.get('id')!r}"
    cut = f" ({len(found) - len(written)} killed before W&B wrote a record)" if len(written) < len(found) else ""
    return Check("W&B", ok, detail + f"; group {group!r} {'named' if named else 'MISSING'} in each{cut}")


CHECKS = (
    check_steps,
    check_anchor_schedule,
    check_topk,
    check_probe,
    check_checkpoints,
    check_resume,
    check_evals,
    check_wandb,
)


# ---------------------------------------- One configuration, a sweep, the command
@dataclass
class Result:
    checks: list[Check]
    seconds: float

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


class Shared:
    """Per task, what every configuration of a rehearsal reuses: the data, the tiny model, the retriever."""

    def __init__(self, root: Path, device: str = "cpu"):
        self.root, self.device = root, device
        self._data: dict[str, RehearsalData] = {}
        self._retriever: subprocess.Popen | None = None
        self.retriever_url: str | None = None

    def data(self, task: str) -> RehearsalData:
        """The task's ``rehearsal_data``: rows generated here, written by the task's own ``prepare``."""
        if task not in self._data:
            module = get_task(task)
            if module.REHEARSAL is None:
                allowed = sorted(n for n, m in tasks.TASKS.items() if getattr(m, "REHEARSAL", None) is not None)
                raise ValueError(f"task.name={task!r} has no rehearsal data; allowed: {', '.join(allowed)}")
            (self.root / task).mkdir(parents=True, exist_ok=True)
            self._data[task] = module.rehearsal_data(self.root / task / "data", ROWS)
        return self._data[task]

    def model(self, task: str) -> str:
        # on cuda one head of 64: head sizes below 32 are not among every vLLM attention backend's
        name, heads = ("model", 4) if self.device == "cpu" else (f"model-{self.device}", 1)
        return build_model(self.root / task / name, self.data(task).sft, heads=heads)

    def prepare(self, cfg) -> tuple[str, RehearsalData, str | None]:
        """The tiny model, the data and (a retrieval task) the retriever's URL that `cfg`'s rehearsal runs with."""
        data = self.data(str(cfg.task.name))
        url = self.retriever(data.corpus) if cfg.backend.verl.multi_turn and data.corpus else None
        return self.model(str(cfg.task.name)), data, url

    def retriever(self, corpus: str) -> str:
        """`emapg retriever serve --corpus` on 127.0.0.1 (started once); its URL."""
        if self._retriever is None:
            port = _free_port()
            cmd = [sys.executable, "-m", "experiments.cli", "retriever", "serve", "--corpus", corpus]
            cmd += ["--host", "127.0.0.1", "--port", str(port)]
            with open(self.root / "retriever.log", "w") as log:  # the child keeps its own copy of the descriptor
                self._retriever = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.retriever_url = f"http://127.0.0.1:{port}"
            _wait_healthy(self.retriever_url, self._retriever, self.root / "retriever.log")
        return self.retriever_url

    def close(self) -> None:
        if self._retriever is not None:
            kill_group(self._retriever)
            self._retriever = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RETRIEVER_START_S = 600.0  # for the retriever to answer GET /health (it takes seconds on an idle machine)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = RETRIEVER_START_S) -> None:
    """Wait for the retriever's GET /health (asked by the client the runs use: it sends $EMAPG_RETRIEVER_TOKEN,
    which the server, started with this environment, then requires); a process that exits fails it at once."""
    client = HTTPRetriever(url, timeout=2.0)
    t0 = time.time()
    try:
        while time.time() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the rehearsal's retriever exited with status {proc.returncode}: {last_error(log)} (log: {log})"
                )
            try:
                client.health()
                return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    finally:
        client.close()
    raise RuntimeError(f"the rehearsal's retriever did not answer at {url} within {timeout_s:.0f} s (log: {log})")


def rehearsal_target(target: list[str], run_dir: Path, shared: Shared, steps: int, *, device: str = "cpu") -> list[str]:
    """`target` (Hydra overrides naming a verl preset) and its rehearsal's overrides on `device` writing to `run_dir`:
    what `emapg train` is given (``rehearse_config``; ``cluster.gpu_smoke`` gives it to `emapg doctor`). The task's
    data, the tiny model and (a retrieval task) the retriever are made in `shared` first."""
    cfg = build.compose(target)
    if cfg.backend.name != "verl":
        raise ValueError(
            f"emapg rehearse takes a verl preset or sweep (backend=verl); {run_name(target)} has "
            f"backend={cfg.backend.name} (run it directly: `emapg train {' '.join(target)} smoke=true`)"
        )
    model, data, url = shared.prepare(cfg)
    return target + rehearsal_overrides(cfg, model, data, run_dir, steps, retriever_url=url, device=device)


def rehearse_config(
    name: str, target: list[str], out: Path, shared: Shared, steps: int, *, device: str = "cpu"
) -> Result:
    """Rehearse one configuration (`target`: Hydra overrides naming a verl preset); see the module docstring."""
    t0 = time.time()
    run_dir = out / name
    overrides = rehearsal_target(target, run_dir, shared, steps, device=device)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir.parent / f"{name}.command.txt").write_text(shlex.join(["emapg", "train", *overrides]) + "\n")
    kill_after = min(KILL_AFTER, steps - 1)
    print(f"{name}: attempt 1, killed after the checkpoint of step {kill_after} ...")
    first = run_attempt(overrides, run_dir, run_dir.parent / f"{name}.attempt1.log", kill_after=kill_after)
    if first.killed_at is None:
        return Result([Check("attempt 1", False, _failure(first))], time.time() - t0)
    print(f"{name}: attempt 2, resumed to step {steps} ...")
    second = run_attempt(overrides + ["resume=true"], run_dir, run_dir.parent / f"{name}.attempt2.log", kill_after=None)
    if second.returncode != 0:
        return Result([Check("attempt 2", False, _failure(second))], time.time() - t0)
    e = expect(run_dir, first.killed_at)
    return Result([check(run_dir, e) for check in CHECKS], time.time() - t0)


def _failure(a: Attempt) -> str:
    if a.timed_out:
        why = f"stalled: no new step, checkpoint or output for too long (stopped after {a.seconds:.0f} s)"
    elif a.returncode == 0:
        why = "finished before reaching its kill point"
    else:
        why = f"exited with status {a.returncode} after {a.seconds:.0f} s"
    return f"{why}; {last_error(a.log)} (log: {a.log})"


def last_error(log: Path, prog: str = "emapg ") -> str:
    """The line of a process's log that says why it failed: its CLI's own one-line error (`prog`...), else the last
    line naming an error, else its last line ("no output" for none); at most 300 characters."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
    ours = [ln for ln in lines if ln.startswith(prog)]
    errors = ours or [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["no output"])[-1].strip()[:300]


def run_name(argv: list[str]) -> str:
    """The run directory's name for the configuration `experiment=... key=value ...`, without '=' (which Hydra would
    read in run_dir=...). A sweep spec is rehearsed through Ray Tune by ``rehearse.sweep``."""
    if any(a.endswith((".yaml", ".yml")) for a in argv):
        raise ValueError(f"a sweep spec is rehearsed with `emapg rehearse <spec.yaml>`; got {argv}")
    exp = next((a.split("=", 1)[1] for a in argv if a.startswith("experiment=")), "custom")
    rest = [a.split("=", 1) for a in argv if not a.startswith("experiment=") and "=" in a]
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "__".join([exp] + [f"{k.rsplit('.', 1)[-1]}-{v}" for k, v in rest]))[:120]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="emapg rehearse",
        description="Run a GPU preset's (or a verl sweep's) real verl loop on CPU (--device cuda: one GPU, vLLM) "
        "in minutes: kill after step 2, resume, check. See docs/scaling-out.md.",
        epilog="Example: emapg rehearse experiment=math_deepscaler_ema_pg algo.kl.type=topk_reverse",
    )
    p.add_argument(
        "target", nargs="+", help="experiment=<verl preset> [key=value ...] (a verl sweep spec: emapg rehearse)"
    )
    p.add_argument(
        "--steps", type=int, default=3, help="training steps (>= 3; the first attempt is killed after step 2)"
    )
    p.add_argument("--out", default="outputs/rehearsals", help="where the run directories and logs go")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: verl's CPU mode, hf engine; cuda: one GPU, vLLM"
    )
    args = p.parse_args(argv)
    if args.steps < 3:
        raise ValueError(f"--steps={args.steps}: a rehearsal needs at least 3 steps (kill after 2, resume to the end)")
    if args.device == "cuda":
        require_cuda(args.target)
    require_verl()
    name, out = run_name(args.target), Path(args.out)
    shared = Shared(out / "_shared", args.device)
    try:
        result = rehearse_config(name, args.target, out, shared, args.steps, device=args.device)
    finally:
        shared.close()
    print(f"{name} ({result.seconds:.0f} s): {'passed' if result.ok else 'FAILED'}")
    for c in result.checks:
        print(c.line())
    bad = [c for c in result.checks if not c.ok]
    if not bad:
        return 0
    (out / f"{name}.failure.txt").write_text("\n".join(c.line() for c in bad) + "\n")  # beside its attempts' logs
    print(failed_line(f"{name}: {bad[0].name}: {bad[0].detail}", out))
    return 1


def no_cuda() -> str | None:
    """Why torch sees no CUDA device here, in words; None when it sees one."""
    if torch.cuda.is_available():
        return None
    kind = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"torch {torch.__version__} ({kind}) sees none"


def require_cuda(target: list[str]) -> None:
    """ValueError, before any work, unless a --device cuda rehearsal of `target` can start here: a CUDA device, and
    vLLM (the CPU rehearsal's hf engine runs on CPU only)."""
    if why := no_cuda():
        raise ValueError(
            f"--device cuda needs a CUDA device: {why}; on CPU: `emapg rehearse {shlex.join(target)}` "
            "(--device cpu, the default)"
        )
    try:
        importlib.import_module("vllm")
    except Exception as e:  # noqa: BLE001  not installed, or broken (a CUDA library it cannot load, ...)
        raise ValueError(
            "--device cuda rolls out with vLLM (backend.verl.rollout_engine=vllm), which does not import here: "
            f"{(str(e) or type(e).__name__).splitlines()[0]}; install verl's vLLM stack: cluster/gpu-install.sh "
            "(docs/scaling-out.md)"
        ) from None


def failed_line(what: str, logs: Path) -> str:
    """The last line of a failed rehearsal: what failed (one line, at most 400 characters) and the directory that
    holds every log of it."""
    what = " ".join(what.split())
    return f"FAILED: {what if len(what) <= 400 else what[:399] + '…'}; logs: {logs.resolve()}"
