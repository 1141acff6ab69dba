"""Supervised warm start of a tiny model on task demonstrations, cached by a hash of its config and provenance.

    emapg pretrain task=math_tiny
    emapg pretrain task=search_tiny steps=300 model.layers=4 knobs.two_hop=0.3 eval=true

RL from a random tiny model never sees a reward, so each `*_tiny` task first gets a short SFT
phase: next-token loss on prompt + demonstration, counted only on the tokens the model would
generate (the prompt and the environment's `<information>` blocks get no loss), plus EOS. The
result is an HF checkpoint (`AutoModelForCausalLM` / `AutoTokenizer` load it) in
`<cache_dir>/<task>-<hash of the resolved config and its provenance>/`: the provenance is whatever else decides
the weights (the builder's source code, the numerical code path, thread count and library versions:
`provenance`). A directory with the completion marker is reused, so the warm start is built once per config and
provenance, whoever asks for it; one whose marker records another provenance, or whose files are not those its
marker records (sizes and sha256: a truncated copy, a disk error), is rebuilt, saying why in one line.

The calibrated defaults (each task module's `PRETRAIN`) leave the model neither hopeless nor solved on held-out
problems (target 15-60%, greedy and sampled at temperature 1) so that RL has room to improve: SFT
stops as soon as greedy accuracy on validation problems (train split, held out from SFT) reaches
`target_acc`, which is robust to seeds and hardware where a fixed step count is not (the tiny
model's accuracy jumps within a few hundred steps, at a seed-dependent time). The measured
numbers are in the `PRETRAIN` docstrings.

Simplifications compared with the paper: the paper starts from pretrained Qwen models; here a
~0.5M-parameter char-level Qwen2 gets about a minute of SFT on synthetic demonstrations.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ema_pg_core.local import tiny
from ema_pg_core.local.tiny import build_model, build_tokenizer
from experiments import numerics, records, tasks, user_yaml
from experiments.progress import bar as progress_bar
from experiments.tasks import Example, get_task, make_knobs

# Written last into a finished warm start: the resolved config, its provenance, training statistics and the size
# and sha256 of each of its files (`files`).
MARKER = "pretrain.json"
# The tiny model's sizes PretrainConfig.model may set: build_model's keyword arguments, with their defaults.
MODEL_DEFAULTS = {
    k: p.default for k, p in inspect.signature(build_model).parameters.items() if k not in ("tokenizer", "seed")
}


@dataclass
class PretrainConfig:
    """One warm start. Every field enters the cache hash."""

    task: str = "math_tiny"  # experiments.tasks.TASKS
    knobs: dict = field(default_factory=dict)  # the task's difficulty / world; {} = its calibrated defaults
    model: dict = field(default_factory=dict)  # keyword arguments of ema_pg_core.local.tiny.build_model
    steps: int = 1000  # at most (training usually stops earlier, at target_acc)
    target_acc: float | None = 0.35  # stop once greedy validation accuracy reaches this; None = run all steps
    eval_every: int = 20
    val_size: int = 64  # validation problems: from the train split, never in the SFT pool (test stays untouched)
    batch_size: int = 32
    lr: float = 3e-3  # AdamW (linear warmup over WARMUP_STEPS, then constant)
    weight_decay: float = 0.01
    pool: int = 8192  # train examples drawn once (search_tiny repeats its ~700 questions); batches sample them
    seed: int = 0  # the data, the initialisation and the batch order

    def __post_init__(self):
        for name in ("steps", "batch_size", "pool", "eval_every", "val_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"pretrain {name} must be an integer >= 1; got {getattr(self, name)!r}")
        if self.target_acc is not None and not 0.0 < self.target_acc <= 1.0:
            raise ValueError(f"pretrain target_acc must be in (0, 1] or null; got {self.target_acc!r}")
        if not self.lr > 0:
            raise ValueError(f"pretrain lr must be > 0; got {self.lr!r}")
        if unknown := sorted(set(self.model) - set(MODEL_DEFAULTS)):
            raise ValueError(f"unknown pretrain model key(s) {unknown}; allowed: {', '.join(MODEL_DEFAULTS)}")


def resolve(task: str, **overrides) -> PretrainConfig:
    """The calibrated config of `task` (its module's `PRETRAIN`) with `overrides` applied."""
    values = {**get_task(task).PRETRAIN, **overrides}
    cfg = make_knobs(PretrainConfig, "pretrain", {"task": task, **values})
    # Canonical form (every knob and model argument spelled out) so equal configs hash equally.
    cfg.knobs = asdict(make_knobs(get_task(task).Knobs, task, cfg.knobs))
    cfg.model = {**MODEL_DEFAULTS, **cfg.model}
    return cfg


def provenance(task: str) -> dict:
    """What besides its config decides a warm start's weights: {"builder": sha256 (16 hex digits) of the code that
    builds it (this module, the tiny model and tokenizer, the task registry and the task's module: its data and
    demonstrations), "numerics": the code paths, thread count and library versions in effect
    (experiments.records.comparable_numerics)}."""
    digest = hashlib.sha256()
    for source in (__file__, tiny.__file__, tasks.__file__, inspect.getfile(get_task(task))):
        digest.update(Path(source).read_bytes())
    return {"builder": digest.hexdigest()[:16], "numerics": records.comparable_numerics(numerics.fingerprint())}


def cache_name(cfg: PretrainConfig, built: dict) -> str:
    """<task>-<12 hex digits of records.config_hash over the resolved config and its provenance `built`>."""
    return f"{cfg.task}-{records.config_hash({'cfg': asdict(cfg), 'provenance': built})}"


def stale(path: Path, built: dict) -> str | None:
    """Why the finished warm start at `path` may not be reused: what its marker records that differs from
    provenance `built` ("numerics.versions.torch: '2.12.0' -> '2.13.0'"); None when it matches."""
    old, new = records.flat(json.loads((path / MARKER).read_text()).get("provenance") or {}), records.flat(built)
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys) or None


def files(path: Path) -> dict[str, dict]:
    """{relative name: {"bytes", "sha256"}} of every file of the warm start at `path` but its marker."""
    out = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MARKER):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()  # a tiny model's files: megabytes
        out[f.relative_to(path).as_posix()] = {"bytes": f.stat().st_size, "sha256": digest}
    return out


def damaged(path: Path) -> str | None:
    """What of the finished warm start at `path` is not as its marker records ("model.safetensors is 1,024 bytes,
    recorded 2,048"); None when every file is as recorded."""
    try:
        recorded = json.loads((path / MARKER).read_text(encoding="utf-8"))["files"]
        sizes = {name: int(f["bytes"]) for name, f in recorded.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # cut short, not JSON, not this format
        return f"{MARKER} is unreadable"
    for name, size in sizes.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if (path / name).stat().st_size != size:
            return f"{name} is {(path / name).stat().st_size:,} bytes, recorded {size:,}"
    now = files(path)
    changed = [name for name in recorded if now[name]["sha256"] != recorded[name]["sha256"]]
    return f"{changed[0]} changed since it was built (its sha256 differs from the recorded)" if changed else None


def unusable(path: Path, built: dict) -> str | None:
    """Why the finished warm start at `path` must be rebuilt (`damaged`, else `stale`); None if reusable/unfinished."""
    if not (path / MARKER).exists():
        return None
    if broken := damaged(path):
        return f"is damaged ({broken})"
    why = stale(path, built)
    return f"was built otherwise ({why})" if why else None


def default_cache_dir() -> Path:
    """$EMAPG_CACHE (else ~/.cache/emapg), as the run config's model.cache_dir."""
    return Path(os.environ.get("EMAPG_CACHE") or Path.home() / ".cache" / "emapg")


# ---------------------------------------------------------------- data
def segments(task, example: Example, response: str, env) -> list[tuple[str, bool]]:
    """Split a full `response` into (text, generated_by_model) pieces by replaying the task's tool protocol: after
    each stop string the environment's `tool_response` text must follow (ValueError when it does not)."""
    out, pos = [], 0
    while True:
        ends = [response.find(s, pos) + len(s) for s in task.STOP_STRINGS if response.find(s, pos) != -1]
        if not ends:
            return out + [(response[pos:], True)]
        stop = min(ends)
        out.append((response[pos:stop], True))
        injected = task.tool_response(response[:stop], env)
        if injected is None:  # the stop did not trigger a tool call: keep generating
            return out[:-1] + [(response[pos:], True)]
        if not response.startswith(injected, stop):
            raise ValueError(f"{example.id}: demonstration differs from the environment's response")
        out.append((injected, False))
        pos = stop + len(injected)


def encode_example(tokenizer, task, example: Example, response: str, env) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for prompt + response + EOS; labels are -100 except on model-generated tokens and EOS."""
    ids = tokenizer(task.prompt(example), add_special_tokens=False).input_ids
    labels = [-100] * len(ids)
    for text, trainable in segments(task, example, response, env):
        piece = tokenizer(text, add_special_tokens=False).input_ids
        ids += piece
        labels += piece if trainable else [-100] * len(piece)
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence: input_ids, attention_mask, labels, each (B, L)."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (x, y) in enumerate(batch):
        ids[row, : len(x)], labels[row, : len(y)], mask[row, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ---------------------------------------------------------------- training
WARMUP_STEPS = 50  # linear warmup, then constant (early stopping makes a decay schedule's end arbitrary)


def _split_val(examples: list[Example], val_size: int) -> tuple[list[Example], list[Example]]:
    """(pool, val): the first `val_size` distinct problems are validation; the pool excludes them."""
    val: dict[str, Example] = {}
    for ex in examples:
        if len(val) == val_size:
            break
        val.setdefault(ex.id, ex)
    pool = [ex for ex in examples if ex.id not in val]
    if not pool:
        raise ValueError(f"no SFT examples left after taking val_size={val_size} validation problems")
    return pool, list(val.values())


def accuracy(model, tokenizer, task, env, examples: list[Example], *, greedy: bool = True) -> float:
    """Greedy (else sampled) accuracy on `examples` (model left in eval mode)."""
    model.eval()
    responses = rollout(model, tokenizer, task, env, [task.prompt(ex) for ex in examples], greedy=greedy)
    return sum(task.evaluate(ex, r) for ex, r in zip(examples, responses)) / len(examples)


def train(cfg: PretrainConfig, out_dir: Path, progress: bool = True) -> dict[str, float]:
    """Run the SFT of `cfg` (stopping at `target_acc`), save model + tokenizer into `out_dir`; return statistics."""
    wall, cpu = time.perf_counter(), time.process_time()
    task = get_task(cfg.task)
    env = task.make_env(**cfg.knobs)
    rng = random.Random(cfg.seed)
    tokenizer = build_tokenizer()
    n_pool = min(cfg.pool, cfg.steps * cfg.batch_size)  # more could never be sampled
    pool, val = _split_val(task.load("train", n_pool + cfg.val_size, seed=cfg.seed, **cfg.knobs), cfg.val_size)
    data = [encode_example(tokenizer, task, ex, task.demonstration(ex, rng), env) for ex in pool]
    model = build_model(tokenizer, seed=cfg.seed, **cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    losses, val_acc, step = [], 0.0, 0
    recent_loss = lambda: sum(losses[-20:]) / len(losses[-20:])  # the last 20 steps
    bar = progress_bar(cfg.steps, f"pretrain {cfg.task}", show=progress)
    for step in range(1, cfg.steps + 1):
        model.train()
        batch = collate([data[rng.randrange(len(data))] for _ in range(cfg.batch_size)], tokenizer.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / WARMUP_STEPS)
        loss = model(**batch).loss  # mean next-token CE over labelled (model-generated) tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(1)
        if cfg.target_acc is not None and step % cfg.eval_every == 0:
            val_acc = accuracy(model, tokenizer, task, env, val)
            bar.set_postfix(loss=f"{recent_loss():.3f}", val_acc=f"{val_acc:.2f}", refresh=False)
            if val_acc >= cfg.target_acc:
                break
    bar.close()
    if cfg.target_acc is None or step % cfg.eval_every:
        val_acc = accuracy(model, tokenizer, task, env, val)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "steps_done": step,
        "val_acc": val_acc,
        "reached_target": cfg.target_acc is None or val_acc >= cfg.target_acc,
        "final_loss": recent_loss(),
        "train_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
    }


def pretrain(
    task: str = "math_tiny",
    *,
    model_cfg: dict | None = None,
    steps: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    knobs: dict | None = None,
    progress: bool = True,
    **overrides,
) -> Path:
    """Path of the warm-started HF checkpoint for this config (`cache_dir/<cache_name>/`); trains it only if not
    cached (see the module docstring). Unset arguments take the task's calibrated values (its `PRETRAIN`);
    `overrides` set other `PretrainConfig` fields. Training happens in a temporary sibling directory renamed into
    place: concurrent callers (sweep trials) never see half a checkpoint."""
    named = dict(model=model_cfg, steps=steps, knobs=knobs)
    cfg = resolve(task, **{k: v for k, v in named.items() if v is not None}, **overrides)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    built = provenance(cfg.task)
    final = root / cache_name(cfg, built)
    why = unusable(final, built)
    if (final / MARKER).exists() and why is None:
        return final
    if why:
        print(f"warm start {final} {why}: rebuilding it", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    stats = train(cfg, tmp, progress=progress)
    if not stats["reached_target"]:
        warnings.warn(
            f"pretrain {cfg.task}: validation accuracy {stats['val_acc']:.2f} did not reach "
            f"target_acc={cfg.target_acc} within steps={cfg.steps}; raise steps",
            stacklevel=2,
        )
    marker = {"config": asdict(cfg), "hash": final.name, "provenance": built, **stats, "files": files(tmp)}
    (tmp / MARKER).write_text(json.dumps(marker, indent=2))
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished first (or a stale, damaged or unfinished dir is in the way)
        if not (final / MARKER).exists() or unusable(final, built):
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------- held-out accuracy
@torch.no_grad()
def rollout(model, tokenizer, task, env, prompts: list[str], *, greedy: bool) -> list[str]:
    """Responses for `prompts` with HF `generate` and the task's tool loop (reference version): each turn generates
    until EOS, a stop string or `task.MAX_NEW_TOKENS`; text `task.tool_response` returns is appended and generation
    continues, at most `task.MAX_TURNS` times. Sampling is at temperature 1, untruncated."""
    responses, active = [""] * len(prompts), list(range(len(prompts)))
    for turn in range(task.MAX_TURNS + 1):
        texts = [prompts[i] + responses[i] for i in active]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = {} if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        out = model.generate(
            **enc,
            max_new_tokens=task.MAX_NEW_TOKENS,
            **sampling,
            stop_strings=list(task.STOP_STRINGS) or None,
            tokenizer=tokenizer,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )  # (B, L + new)
        new = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        still = []
        for i, text in zip(active, new):
            responses[i] += text
            injected = task.tool_response(responses[i], env) if turn < task.MAX_TURNS else None
            if injected is not None:
                responses[i] += injected
                still.append(i)
        active = still
        if not active:
            break
    return responses


def heldout_accuracy(path: str | os.PathLike, task: str, knobs: dict, n: int = 100) -> dict[str, float]:
    """Greedy and sampled accuracy of the checkpoint at `path` on `n` test problems (seed 0)."""
    t = get_task(task)
    env = t.make_env(**knobs)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = t.load("test", n, seed=0, **knobs)
    torch.manual_seed(0)
    greedy = accuracy(model, tokenizer, t, env, examples)
    return {"greedy": greedy, "sampled": accuracy(model, tokenizer, t, env, examples, greedy=False)}


# ---------------------------------------------------------------- CLI
def _parse_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """['task=math_tiny', 'model.layers=4', 'knobs.steps=3'] -> nested dict (YAML-typed values)."""
    out: dict[str, Any] = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"argument {item!r} must look like key=value (e.g. task=math_tiny)")
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        try:
            node[leaf] = user_yaml.loads(value)
        except ValueError as e:
            raise ValueError(f"argument {key}=...: {e}") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`emapg pretrain task=<name> [<PretrainConfig field>=value ...] [model.<k>=v] [knobs.<k>=v]
    [cache_dir=DIR] [eval=true] [threads=1]`: build (or reuse) the warm start and print its path;
    eval=true also prints its greedy and sampled accuracy on 100 test problems."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(main.__doc__)
        return 0
    args = _parse_overrides(argv)
    torch.set_num_threads(int(args.pop("threads", 1)))  # the trainer's default: the same cache entry
    do_eval = bool(args.pop("eval", False))
    task = args.pop("task", "math_tiny")
    model_cfg, knobs = args.pop("model", None), args.pop("knobs", None)
    path = pretrain(task, model_cfg=model_cfg, knobs=knobs, **args)  # unknown keys raise, naming the allowed
    print(path)
    if do_eval:
        acc = heldout_accuracy(path, task, knobs or {})
        print(f"held-out accuracy on 100 test problems: greedy {acc['greedy']:.2f}, sampled {acc['sampled']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
