"""``emapg rehearse``: a GPU preset's real verl loop, run on CPU in minutes, before booking GPUs.

    emapg rehearse experiment=math_deepscaler_ema_pg [overrides ...] [--steps 3] [--out DIR]
    emapg rehearse sweeps/search_r1_ema_pg.yaml                      # each distinct trial config once

A rehearsal keeps every algorithm, loss, anchor, estimator, reward and agent-loop setting of the
target and replaces only what needs a GPU or a download (``rehearsal_overrides``):

    model      a tiny Qwen2 built from a config (char-level tokenizer with a chat template), given a
               few seconds of SFT on the rehearsal data so that rewards and tool calls occur
    data       a few rows generated here and written by the task's own ``prepare`` (the same schema
               as the real data); for search, a generated corpus behind ``emapg retriever serve`` on
               127.0.0.1
    sizes      prompts, responses, turns, batch sizes
    hardware   verl's CPU platform (trainer.device=cpu) and the hf rollout engine; one virtual GPU;
               1 TransferQueue storage unit, 1 agent-loop worker, 1 reward worker; no offloading
    schedule   ``steps`` iterations, a checkpoint each, 2 kept; the anchor period shortened to 2; the KL
               probe (when the target has one) every step, on 2 prompts

It runs ``steps`` iterations in a child process, kills it once the checkpoint of step 2 is on disk,
resumes to ``steps`` in a second process, and checks the run directory (``checks``): every step
recorded, the anchor updated exactly at its scheduled steps, the Top-k statistics present when the
estimator needs them, the KL probe scored at every step on the same tokens across the kill,
checkpoints with their anchor written and pruned, and the resume continuing the step count and the
anchor. Exit status 0 only when every check passed.

What a rehearsal proves and what it cannot: docs/scaling-out.md.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A minimal chat template over the tiny tokenizer's characters (verl's dataset applies one to every prompt)."""
KILL_AFTER = 2
"""The first attempt is killed once the checkpoint of this step is complete."""
ANCHOR_PERIOD = 2
"""The anchor period of a rehearsal (tau < 1): updates after steps 2, 4, ..."""
ROWS = {"train": 16, "test": 2}
"""Rows of generated data: training prompts, and per benchmark / test source."""
PROMPT_TOKENS = {False: 128, True: 768}
"""backend.verl.max_prompt_length (single-turn math prompts; the Search-R1 template is ~630 tokens here)."""
TURN_TOKENS = {False: 24, True: 40}
"""rollout.max_new_tokens: a boxed sum; a `<search> name </search>` or `<answer> name </answer>` turn."""
PROBE_PROMPTS = 2
"""trainer.probe_size of a rehearsal whose target runs the KL probe (then scored every step)."""
STEP_TIMEOUT_S = 600
"""backend.verl.step_timeout_s of a rehearsal: start-up and each step take well under a minute on CPU."""


# --------------------------------------------------------------------------------------
# The tiny model
# --------------------------------------------------------------------------------------
def build_model(out_dir: Path, sft_texts: list[tuple[str, str]], steps: int = 300, seed: int = 0) -> str:
    """A tiny Qwen2 + char-level tokenizer with ``CHAT_TEMPLATE``, given `steps` of SFT on (prompt, response)
    pairs (loss on the response and EOS only); saved with ``save_pretrained``. Returns the directory."""
    import torch

    from ema_pg_core.local.tiny import build_model as tiny_model
    from ema_pg_core.local.tiny import build_tokenizer

    if (out_dir / "config.json").is_file():
        return str(out_dir)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = tiny_model(tok, hidden=64, layers=2, heads=4, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pairs = [_encode(tok, p, r) for p, r in sft_texts]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = [pairs[int(i)] for i in torch.randint(len(pairs), (8,), generator=g)]
        ids, labels = _pad(batch, tok.pad_token_id)
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


def _pad(batch, pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id)  # (B, L)
    labels = torch.full((len(batch), width), -100)  # (B, L)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)], labels[i, : len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, labels


# --------------------------------------------------------------------------------------
# Data in the real schema
# --------------------------------------------------------------------------------------
@dataclass
class Data:
    """What ``prepare_data`` wrote: parquet files, SFT pairs, and for search the corpus file."""

    files: dict[str, str]
    sft: list[tuple[str, str]]
    corpus: str | None = None
    prompts: list[str] = field(default_factory=list)


def prepare_data(task: str, out_dir: Path) -> Data:
    """Rows generated from the tiny tasks, written by ``experiments.tasks.<task>.prepare``."""
    if task == "math":
        return _math_data(out_dir)
    if task == "search":
        return _search_data(out_dir)
    raise ValueError(f"task.name={task!r} has no rehearsal data; allowed: math, search")


def _math_data(out_dir: Path) -> Data:
    """Single-digit sums: a tiny model learns the format (and some sums) in seconds, so rewards vary."""
    import random

    from experiments.tasks import math

    def sums(n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        return [(f"Compute {a}+{b}", str(a + b)) for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(n))]

    def loader(name: str):
        _, _, _, q_key, a_key = math.SOURCES[name]
        n = ROWS["train"] if name in math.TRAIN else ROWS["test"]
        return [{q_key: q, a_key: a} for q, a in sums(n, seed=sorted(math.SOURCES).index(name))]

    files = math.prepare(str(out_dir), loader=loader)
    sft = [(q, f"{q[len('Compute ') :]}{math.THINK_END}\\boxed{{{a}}}") for q, a in sums(200, seed=100)]
    return Data(files=files, sft=sft)


def _search_data(out_dir: Path) -> Data:
    from experiments.tasks import search, search_tiny

    def loader(source: str, split: str):
        seed = sorted(set(search.TRAIN_SOURCES + search.TEST_SOURCES)).index(source) + (0 if split == "train" else 50)
        n = ROWS["train"] // len(search.TRAIN_SOURCES) if split == "train" else ROWS["test"]
        return [
            {"question": ex.prompt, "golden_answers": list(ex.answer)}
            for ex in search_tiny.load("train", n=n, seed=seed)
        ]

    files = search.prepare(str(out_dir), loader=loader)
    corpus = out_dir / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i, passage in enumerate(search_tiny.corpus()):
            f.write(json.dumps({"id": str(i), "contents": passage}) + "\n")
    env, sft = search_tiny.make_env(), []
    for ex in search_tiny.load("train", n=64, seed=100):  # a whole trajectory: search call, information, answer
        query = f"<search> {ex.meta['subject']} </search>"
        answer = f"<answer> {ex.answer[0]} </answer>"
        sft.append((search.format_question(ex.prompt), query + search.tool_response(query, env) + answer))
    return Data(files=files, sft=sft, corpus=str(corpus))


# --------------------------------------------------------------------------------------
# The rehearsal config
# --------------------------------------------------------------------------------------
def rehearsal_overrides(
    cfg, model_path: str, data: Data, run_dir: Path, steps: int, retriever_url: str | None = None
) -> list[str]:
    """Hydra overrides (appended to the target's) that make `cfg` a CPU rehearsal; see the module docstring."""
    tau = float(cfg.algo.anchor.tau)
    mini = 2 if int(cfg.trainer.mini_batches) > 1 else 1
    multi = bool(cfg.backend.verl.multi_turn)
    o = [
        f"model.path={model_path}",
        f"run_dir={run_dir}",
        "logger.mode=offline",  # W&B as the target logs it, offline (into the run directory; WANDB_MODE too)
        "trainer.device=cpu",
        "backend.verl.rollout_engine=hf",
        "backend.verl.nnodes=1",
        "backend.verl.n_gpus_per_node=1",
        f"backend.verl.train_files={data.files['train']}",
        f"backend.verl.val_files={data.files.get('val', data.files['test'])}",
        f"backend.verl.max_prompt_length={PROMPT_TOKENS[multi]}",
        "backend.verl.param_offload=false",
        "backend.verl.optimizer_offload=false",
        f"backend.verl.checkpoint_dir={run_dir / 'checkpoints'}",
        "backend.verl.max_token_len_per_gpu=4096",
        "backend.verl.micro_batch_size_per_gpu=4",
        f"trainer.iterations={steps}",
        "trainer.save_every=1",
        "trainer.keep_checkpoints=2",
        f"backend.verl.step_timeout_s={STEP_TIMEOUT_S}",
        f"trainer.eval_every={steps}",
        "trainer.eval_n=1",
        f"trainer.mini_batches={mini}",
        "rollout.prompts_per_iter=4",
        "rollout.group_size=2",
        f"rollout.max_new_tokens={TURN_TOKENS[multi]}",
    ]
    if tau < 1.0:
        o.append(f"algo.anchor.period={ANCHOR_PERIOD}")
    if cfg.trainer.probe_every != 0:  # the target's probe (null: the default cadence), every step
        o += ["trainer.probe_every=1", f"trainer.probe_size={PROBE_PROMPTS}"]
    if multi:
        o += [
            "rollout.max_turns=2",
            "backend.verl.max_response_length=224",
            "backend.verl.max_tool_response_length=48",
            f"backend.verl.retriever_url={retriever_url}",
        ]
    else:
        o.append(f"backend.verl.max_response_length={TURN_TOKENS[multi]}")
    infra = [
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "data.dataloader_num_workers=0",
    ]
    extra = list(cfg.backend.verl.overrides) + infra
    o.append("backend.verl.overrides=[" + ",".join(_quote(x) for x in extra) + "]")
    return o


def _quote(s: str) -> str:
    return "'" + s.replace("'", "\\'") + "'"


# --------------------------------------------------------------------------------------
# Running: attempt 1 (killed after step KILL_AFTER's checkpoint), attempt 2 (resume to the end)
# --------------------------------------------------------------------------------------
ATTEMPT_TIMEOUT_S = 900.0
"""An attempt that has not finished (or reached its kill point) by then is stopped and the rehearsal fails."""


@dataclass
class Attempt:
    started: float
    """time.time() when the process was started."""
    returncode: int | None
    """The exit status; None when it was killed (at its kill point, or on timeout)."""
    killed_at: int | None
    """The last complete checkpoint when the attempt was killed (None: it was not killed)."""
    seconds: float
    log: Path
    timed_out: bool = False


def logged_step(run_dir: Path) -> int:
    """The last step this attempt's verl metrics file has training metrics for (0: none)."""
    from experiments.verl_metrics import FILE, trained_step

    steps = [0]
    for line in (run_dir / FILE).read_text().splitlines() if (run_dir / FILE).is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # being written
        if trained_step(row.get("data", {})):
            steps.append(int(row["step"]))
    return max(steps)


def latest_checkpoint(run_dir: Path) -> int:
    """verl's latest complete checkpoint step (its tracker file), 0 when none."""
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def run_attempt(
    overrides: list[str],
    run_dir: Path,
    log: Path,
    kill_after: int | None,
    timeout_s: float = ATTEMPT_TIMEOUT_S,
    on_wait: Callable[[float], None] | None = None,
) -> Attempt:
    """``emapg train <overrides>`` in its own process group; with `kill_after`, SIGKILL the whole group
    (driver, Ray, workers) once the checkpoint of that step is complete and its metrics are logged
    (verl writes them after the checkpoint)."""
    inherited = ("RAY_ADDRESS", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")  # its own Ray; trainer.device decides
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env.update(
        {
            "EMAPG_PROGRESS": "0",
            "PYTHONUNBUFFERED": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "WANDB_MODE": "offline",
        }
    )  # Ray binds 127.0.0.1 and W&B is offline: nothing leaves the machine
    cmd = [sys.executable, "-m", "experiments.cli", "train", *overrides]
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed, timed_out = None, False
        try:
            while proc.poll() is None:
                elapsed = time.time() - t0
                if kill_after is not None and min(latest_checkpoint(run_dir), logged_step(run_dir)) >= kill_after:
                    killed = latest_checkpoint(run_dir)
                    break
                if elapsed > timeout_s:
                    timed_out = True
                    break
                if on_wait is not None:
                    on_wait(elapsed)
                time.sleep(1.0)
        finally:
            kill_group(proc)  # also what outlives the driver in its group (Ray's processes after a crash)
    code = None if killed is not None or timed_out else proc.returncode
    return Attempt(t0, code, killed, time.time() - t0, log, timed_out)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of `proc`'s group (it was started as a session leader), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty
        pass
    proc.wait()


# --------------------------------------------------------------------------------------
# Checks: one line each, from the run directory alone
# --------------------------------------------------------------------------------------
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
    attempts: int = 2
    """verl attempts the run had at least (one offline W&B run each)."""


def _metrics(run_dir: Path) -> dict[int, dict]:
    from experiments.records import read_metrics

    return {int(r["iteration"]): r for r in read_metrics(run_dir) if int(r["iteration"]) > 0}


def _raw_attempts(run_dir: Path) -> list[list[dict]]:
    """verl's own metric lines, one list per attempt, oldest first."""
    from experiments.verl_metrics import attempt_files

    out = []
    for path in attempt_files(run_dir):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by the kill
        out.append(rows)
    return out


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
    keys = {k for rows in _raw_attempts(run_dir) for row in rows for k in row.get("data", {}) if "topk_k" in k}
    ks = sorted({row["data"][k] for rows in _raw_attempts(run_dir) for row in rows for k in keys if k in row["data"]})
    if not e.topk:
        return Check(
            "Top-k statistics",
            not keys,
            "estimator needs none; none computed"
            if not keys
            else f"computed although the estimator does not need them: {sorted(keys)}",
        )
    return Check("Top-k statistics", ks == [float(e.k)], f"head size seen in the actor loss {ks}, expected [{e.k}]")


def check_probe(run_dir: Path, e: Expect) -> Check:
    """The KL probe: finite kl/exact >= 0 and its estimate at every step, and the same probe tokens in every
    checkpoint, those written after the resume included (the resumed run scores the tokens it captured)."""
    import math

    import torch

    from ema_pg_core.telemetry import PROBE_KEYS
    from ema_pg_core.verl.probe import PROBE_FILE

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
    if e.killed_at is None:
        return Check("resume", False, "the first attempt was not killed at a checkpoint")
    from experiments.verl_metrics import trained_step

    attempts = _raw_attempts(run_dir)
    resumed = sorted(int(r["step"]) for r in attempts[-1] if trained_step(r.get("data", {}))) if attempts else []
    first_ok = bool(resumed) and resumed[0] == e.killed_at + 1
    detail = f"killed after the checkpoint of step {e.killed_at}; the resumed attempt trained steps {resumed}"
    if e.tau >= 1.0:
        return Check("resume", first_ok and len(attempts) >= 2, detail)
    meta = run_dir / "checkpoints" / f"global_step_{e.steps}" / "anchor" / "emapg_anchor.json"
    updates = json.loads(meta.read_text())["num_updates"] if meta.is_file() else None
    want = e.steps // e.period
    return Check(
        "resume",
        first_ok and updates == want,
        detail + f"; anchor updates at step {e.steps}: {updates} (scheduled {want}, counted across the kill)",
    )


def check_evals(run_dir: Path, e: Expect) -> Check:
    """Per-problem rows of the last step's validation for the policy and, evaluated with its own weights,
    the EMA anchor, and the anchor's metrics beside the policy's."""
    from experiments.records import read_evals

    rows = [r for r in read_evals(run_dir) if r["iteration"] == e.steps]
    per = {m: sorted(r["problem_id"] for r in rows if r["model"] == m) for m in ("policy", "anchor")}
    anchor_keys = sorted(k for k in _metrics(run_dir).get(e.steps, {}) if k.startswith("eval_anchor/"))
    ok = bool(per["policy"]) and per["policy"] == per["anchor"] and bool(anchor_keys)
    detail = (
        f"step {e.steps}: {len(per['policy'])} policy and {len(per['anchor'])} anchor rows in evals.jsonl "
        f"(same problems: {per['policy'] == per['anchor']}); anchor metrics {anchor_keys}"
    )
    return Check("evaluation rows", ok, detail)


def check_wandb(run_dir: Path, e: Expect) -> Check:
    """verl's tracker wrote an offline W&B run per attempt, all under the run's one id (kept in wandb_run.json),
    in the run's group; or none at all when the target's logger is none."""
    import yaml

    from experiments.records import read_wandb_state

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    lg, state = cfg.get("logger") or {}, read_wandb_state(run_dir)
    found = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    if lg.get("name") == "none":
        return Check("W&B", not found and not state, f"logger=none: {len(found)} W&B runs written (expected 0)")
    group = lg.get("group") or (cfg.get("sweep") or {}).get("name") or cfg.get("experiment")
    ids = sorted({p.parent.name.rsplit("-", 1)[1] for p in found})
    named = all(str(group).encode() in p.read_bytes() for p in found)  # the run record inside names the group
    ok = ids == [state.get("id")] and len(found) >= e.attempts and named and state.get("mode") == "offline"
    detail = f"{len(found)} offline runs (one per attempt) with ids {ids}, wandb_run.json id {state.get('id')!r}"
    return Check("W&B", ok, detail + f"; group {group!r} {'named' if named else 'MISSING'} in each")


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


# --------------------------------------------------------------------------------------
# One configuration, a sweep, the command
# --------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    checks: list[Check]
    seconds: float

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


class Shared:
    """Per task, what every configuration of a rehearsal reuses: the data, the tiny model, the retriever."""

    def __init__(self, root: Path):
        self.root = root
        self._data: dict[str, Data] = {}
        self._retriever: subprocess.Popen | None = None
        self.retriever_url: str | None = None

    def data(self, task: str) -> Data:
        if task not in self._data:
            path = self.root / task
            path.mkdir(parents=True, exist_ok=True)
            self._data[task] = prepare_data(task, path / "data")
        return self._data[task]

    def model(self, task: str) -> str:
        return build_model(self.root / task / "model", self.data(task).sft)

    def retriever(self, corpus: str) -> str:
        """`emapg retriever serve --corpus` on 127.0.0.1 (started once); its URL."""
        if self._retriever is None:
            port = _free_port()
            cmd = [
                sys.executable,
                "-m",
                "experiments.cli",
                "retriever",
                "serve",
                "--corpus",
                corpus,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            with open(self.root / "retriever.log", "w") as log:  # the child keeps its own copy of the descriptor
                self._retriever = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.retriever_url = f"http://127.0.0.1:{port}"
            _wait_healthy(self.retriever_url, self._retriever)
        return self.retriever_url

    def close(self) -> None:
        if self._retriever is not None:
            kill_group(self._retriever)
            self._retriever = None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Wait for the retriever's GET /health (asked by the client the runs use: it sends $EMAPG_RETRIEVER_TOKEN,
    which the server, started with this environment, then requires)."""
    import httpx

    from experiments.retrieval.service import HTTPRetriever

    client = HTTPRetriever(url, timeout=2.0)
    t0 = time.time()
    try:
        while time.time() - t0 < timeout_s:
            if proc.poll() is not None:
                status = proc.returncode
                raise RuntimeError(f"the rehearsal's retriever exited with status {status} (see retriever.log)")
            try:
                client.health()
                return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    finally:
        client.close()
    raise RuntimeError(f"the rehearsal's retriever did not answer at {url} within {timeout_s:.0f} s")


def rehearse_config(
    name: str, target: list[str], out: Path, shared: Shared, steps: int, say: Callable[[str], None] = print
) -> Result:
    """Rehearse one configuration (`target`: Hydra overrides naming a verl preset); see the module docstring."""
    from experiments import build

    t0 = time.time()
    cfg = build.compose(target)
    if cfg.backend.name != "verl":
        raise ValueError(
            f"emapg rehearse takes a verl preset or sweep (backend=verl); {name} has "
            f"backend={cfg.backend.name} (run it directly: `emapg train {' '.join(target)} smoke=true`)"
        )
    task = str(cfg.task.name)
    data = shared.data(task)
    url = shared.retriever(data.corpus) if cfg.backend.verl.multi_turn and data.corpus else None
    run_dir = out / name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    overrides = target + rehearsal_overrides(cfg, shared.model(task), data, run_dir, steps, url)
    (run_dir.parent / f"{name}.command.txt").write_text(shlex.join(["emapg", "train", *overrides]) + "\n")
    kill_after = min(KILL_AFTER, steps - 1)
    say(f"{name}: attempt 1, killed after the checkpoint of step {kill_after} ...")
    first = run_attempt(overrides, run_dir, run_dir.parent / f"{name}.attempt1.log", kill_after)
    if first.killed_at is None:
        return Result(name, [Check("attempt 1", False, _failure(first))], time.time() - t0)
    say(f"{name}: attempt 2, resumed to step {steps} ...")
    second = run_attempt(overrides + ["resume=true"], run_dir, run_dir.parent / f"{name}.attempt2.log", None)
    if second.returncode != 0:
        return Result(name, [Check("attempt 2", False, _failure(second))], time.time() - t0)
    kl = cfg.algo.kl
    from ema_pg_core.config import KLConfig
    from ema_pg_core.verl.config import uses_topk

    expect = Expect(
        steps=steps,
        tau=float(cfg.algo.anchor.tau),
        period=ANCHOR_PERIOD if cfg.algo.anchor.tau < 1 else int(cfg.algo.anchor.period),
        topk=uses_topk(KLConfig(**kl)),
        k=int(kl.k),
        keep=2,
        killed_at=first.killed_at,
        probe=cfg.trainer.probe_every != 0,
    )
    return Result(name, [check(run_dir, expect) for check in CHECKS], time.time() - t0)


def _failure(a: Attempt) -> str:
    if a.timed_out:
        why = f"still running after {a.seconds:.0f} s (stopped)"
    elif a.returncode == 0:
        why = "finished before reaching its kill point"
    else:
        why = f"exited with status {a.returncode} after {a.seconds:.0f} s"
    lines = [ln for ln in a.log.read_text(errors="replace").splitlines() if ln.strip()] if a.log.exists() else []
    ours = [ln for ln in lines if ln.startswith("emapg ")]  # the CLI's own one-line error
    errors = ours or [ln for ln in lines if "Error" in ln or "error:" in ln]
    return f"{why}; {(errors or lines or ['no output'])[-1][:300]} (log: {a.log})"


def targets(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(name, Hydra overrides) of the one configuration `experiment=... key=value ...` (a sweep spec is rehearsed
    through Ray Tune by ``sweeps.rehearse``, which `emapg rehearse <spec.yaml>` runs)."""
    if any(a.endswith((".yaml", ".yml")) for a in argv):
        raise ValueError(f"a sweep spec is rehearsed with `emapg rehearse <spec.yaml>`; got {argv}")
    exp = next((a.split("=", 1)[1] for a in argv if a.startswith("experiment=")), "custom")
    rest = [a.split("=", 1) for a in argv if not a.startswith("experiment=") and "=" in a]
    return [(_slug([exp] + [f"{k.rsplit('.', 1)[-1]}-{v}" for k, v in rest]), list(argv))]


def _slug(parts: list[str]) -> str:
    """A run-directory name (no '=', which Hydra would read in run_dir=...)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "__".join(parts))[:120]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="emapg rehearse",
        description="Run a GPU preset's (or a verl sweep's) real "
        "verl loop on CPU in minutes: kill after step 2, resume, check. See docs/scaling-out.md.",
        epilog="Example: emapg rehearse experiment=math_deepscaler_ema_pg algo.kl.type=topk_reverse",
    )
    p.add_argument(
        "target", nargs="+", help="experiment=<verl preset> [key=value ...] (a verl sweep spec: emapg rehearse)"
    )
    p.add_argument(
        "--steps", type=int, default=3, help="training steps (>= 3; the first attempt is killed after step 2)"
    )
    p.add_argument("--out", default="outputs/rehearsals", help="where the run directories and logs go")
    args = p.parse_args(argv)
    if args.steps < 3:
        raise ValueError(f"--steps={args.steps}: a rehearsal needs at least 3 steps (kill after 2, resume to the end)")
    from ema_pg_core.verl import require_verl

    require_verl()
    configs = targets(args.target)
    out = Path(args.out)
    shared = Shared(out / "_shared")
    results = []
    try:
        for name, target in configs:
            result = rehearse_config(name, target, out, shared, args.steps)
            print(f"{name} ({result.seconds:.0f} s): {'passed' if result.ok else 'FAILED'}")
            for c in result.checks:
                print(c.line())
            results.append(result)
    finally:
        shared.close()
    if len(results) > 1:
        print("\n" + table(results))
    return 0 if all(r.ok for r in results) else 1


def table(results: list[Result]) -> str:
    """One row per configuration: passed, or the checks that failed."""
    rows = [
        f"| {r.name} | {'passed' if r.ok else 'FAILED: ' + ', '.join(c.name for c in r.checks if not c.ok)} "
        f"| {r.seconds:.0f} s |"
        for r in results
    ]
    return "\n".join(["| configuration | result | time |", "|---|---|---|", *rows])
