"""``emapg eval TARGET``: evaluate saved models without training; per-problem rows for pass@k.

    emapg eval outputs/runs/<run>                                  # the run's policy and EMA anchor
    emapg eval outputs/runs/<run>/checkpoints/iter_000040          # one checkpoint's policy and anchor
    emapg eval ~/models/m --task math --benchmarks aime2024,amc --out outputs/evals/m   # any HF model
    ... --protocol readme|benchmark|in_training [--n 32 --temperature 0.8 --top-p 0.9 --max-tokens 28000]

TARGET is a run directory (its `final/policy` and `final/anchor`, else its newest checkpoint), a local
checkpoint (policy and anchor) or a Hugging Face model directory (`policy`; `--task` names the task). A verl run's
`global_step_N` is evaluated after verl's model merger has made its actor a Hugging Face directory.

The protocols are `experiments.tasks.math.PROTOCOLS`; each option overrides one of their settings (with Hugging
Face generation the length is cut to what the context window leaves). Each problem gets one greedy answer and n
samples, scored 0/1 by the task's `evaluate`, and one line in `evals.jsonl` (docs/run-record.md): a run's go to
`<run_dir>/evals/<name>/` (where `emapg report` reads them), any other to `--out`; `eval_summary.json` holds pass@k
and greedy accuracy per model and benchmark.

Problems go in chunks of `--batch`, each appended in one write and sampled with its own seed (`chunk_seed`), so a
killed evaluation resumes at the first unfinished chunk, never scores a problem twice, and samples what an
uninterrupted one would. Generation: the local backend's rollout (tool loop included), or vLLM (`--engine vllm`,
single-turn tasks; `auto` picks it when vLLM is installed and a GPU is present).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from ema_pg_core.config import RolloutConfig
from ema_pg_core.local.checkpoints import candidates
from ema_pg_core.local.device import resolve_device
from ema_pg_core.local.rollout import rollout
from experiments import build, progress, records
from experiments.errors import UserError
from experiments.ops.retrieval.service import HTTPRetriever
from experiments.schema import TaskConfig
from experiments.tasks import TASKS, ToolEnvAdapter
from experiments.tasks.math import PROTOCOLS, pass_at_k

ENGINES = ("auto", "hf", "vllm")


@dataclass
class Target:
    kind: str  # run | checkpoint | model
    path: Path
    run_dir: Path | None
    cfg: DictConfig | None  # the run's config.yaml (None for a bare model directory)
    iteration: int  # of the evaluated weights (0 for a bare model)


# ---------------------------------------------------------------- what to evaluate
def resolve_target(path: str) -> Target:
    """TARGET -> Target; a UserError naming it when it is none of the three kinds, or cannot be evaluated."""
    p = Path(path).expanduser()
    if (p / records.CONFIG).is_file() and (p / records.STATUS).is_file():
        last = max((int(r["iteration"]) for r in records.read_metrics(p)), default=0)
        t = Target("run", p, p, OmegaConf.load(p / records.CONFIG), last)
    elif (p / "state.pt").is_file() and (p.parent.parent / records.CONFIG).is_file():
        iteration = int(p.name[5:]) if re.fullmatch(r"iter_\d+", p.name) else 0
        t = Target("checkpoint", p, p.parent.parent, OmegaConf.load(p.parent.parent / records.CONFIG), iteration)
    elif (p / "config.json").is_file():
        return Target("model", p, None, None, 0)
    else:
        raise UserError(
            f"TARGET {path!r} is not a run directory (config.yaml + status), a local checkpoint "
            "(checkpoints/iter_N with state.pt) or a Hugging Face model directory (config.json)"
        )
    if t.cfg.backend.name == "verl":
        raise UserError(
            f"TARGET {t.path} is a verl run: merge a checkpoint into a Hugging Face directory first "
            "(python -m verl.model_merger merge --backend fsdp --local_dir <global_step_N>/actor "
            "--target_dir <dir>; the anchor: <global_step_N>/anchor) and evaluate that directory"
        )
    if t.kind == "run" and not (t.path / "final" / "policy").is_dir() and not (t.path / "checkpoints").is_dir():
        raise UserError(f"TARGET {t.path} holds neither final/policy nor checkpoints/: nothing to evaluate")
    return t


def model_loaders(t: Target) -> dict[str, Any]:
    """{model name: () -> (model, tokenizer)}: policy and anchor of a run or checkpoint, policy of a model dir."""
    final = t.path / "final"
    if t.kind == "model":
        return {"policy": lambda: _hf(t.path, t.path)}
    if t.kind == "run" and (final / "policy").is_dir():
        out = {"policy": lambda: _hf(final / "policy", final / "policy")}
        if (final / "anchor").is_dir():
            out["anchor"] = lambda: _hf(final / "anchor", final / "policy")
        return out
    step = t.path
    if t.kind == "run":
        found = candidates(t.path / "checkpoints")  # newest first
        if not found:
            raise UserError(f"{t.path / 'checkpoints'} holds no checkpoint to evaluate")
        step = found[0]
    return {who: (lambda who=who: _from_checkpoint(t.cfg, step, who)) for who in ("policy", "anchor")}


def _hf(model_dir: Path, tok_dir: Path):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(model_dir), tok


def _from_checkpoint(cfg: DictConfig, step: Path, who: str):
    """The run's model architecture with the checkpoint's policy or anchor weights."""
    model, tok = build.model(cfg)
    state = torch.load(step / "state.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["policy"] if who == "policy" else state["anchor"]["module"])
    return model, tok


# ---------------------------------------------------------------- problems and settings
def problems(module, task_cfg: DictConfig, benchmark: str, limit: int | None) -> list:
    """The benchmark's problems: the task's test split (as in training) or a prepared benchmark file."""
    knobs = OmegaConf.to_container(task_cfg.knobs, resolve=True)
    split, n = ("test", int(task_cfg.test_size)) if benchmark == task_cfg.name else (benchmark, 10**9)
    exs = module.load(split, n=n, seed=int(task_cfg.data_seed), **knobs)
    return exs[:limit] if limit else exs


def settings(args: argparse.Namespace, t: Target, task: str, benchmarks: list[str], engine: str) -> dict:
    """The evaluation's settings (eval.json): the protocol's, each overridden by its option."""
    p = PROTOCOLS[args.protocol]
    given = {k: getattr(args, k) for k in ("n", "temperature", "top_p", "max_tokens")}
    return {
        "target": str(t.path.resolve()),
        "kind": t.kind,
        "task": task,
        "iteration": t.iteration,
        "protocol": args.protocol,
        "benchmarks": benchmarks,
        **{k: getattr(p, k) if v is None else v for k, v in given.items()},
        "seed": p.seed if p.seed is not None else 0,
        "limit": args.limit,
        "batch": args.batch,
        "engine": engine,
    }


def out_dir(args: argparse.Namespace, t: Target) -> Path:
    """--out, else <run_dir>/evals/<protocol> (a checkpoint's: <protocol>_iter_<N>)."""
    if args.out:
        return Path(args.out).expanduser()
    if t.run_dir is None:
        raise UserError(f"TARGET {t.path} is a model directory, not a run: give --out DIR for its evaluation")
    name = args.protocol + (f"_{t.path.name}" if t.kind == "checkpoint" else "")
    return t.run_dir / records.EVAL_ROOT / name


# ---------------------------------------------------------------- generation and scoring
def chunk_seed(seed: int, model: str, benchmark: str, chunk: int) -> int:
    """The generator seed of one chunk: fixed by what it evaluates, whatever ran before it."""
    return seed * 1_000_003 + zlib.crc32(f"{model}/{benchmark}/{chunk}".encode())


def hf_samples(model, tok, prompts: list[str], st: dict, seed: int, *, env, rollout_kw: dict) -> tuple[list, list]:
    """(greedy texts, sampled texts) for P prompts: P greedy and P * n samples (prompt-major), on the
    local backend's rollout (KV cache, stop strings, tool loop)."""
    device = next(model.parameters()).device
    kw = {"max_new_tokens": fit_context(model, tok, prompts, st["max_tokens"]), "env": env, **rollout_kw}
    greedy = rollout(model, tok, prompts, greedy=True, **kw)
    gen = torch.Generator(device=device).manual_seed(seed)
    many = [p for p in prompts for _ in range(st["n"])]
    sampled = rollout(model, tok, many, temperature=st["temperature"], top_p=st["top_p"], generator=gen, **kw)
    return [t.text for t in greedy], [t.text for t in sampled]


def fit_context(model, tok, prompts: list[str], max_tokens: int) -> int:
    """max_tokens, cut to what the model's context window leaves after the longest prompt (a protocol's
    28k tokens on a model with a 1k-token window would index past its positions)."""
    window = getattr(model.config, "max_position_embeddings", None)
    if not window:
        return max_tokens
    longest = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    return max(1, min(max_tokens, int(window) - longest))


def vllm_samples(model_dir: str, prompts: list[str], st: dict, seed: int) -> tuple[list, list]:
    """The same with vLLM's offline engine (what verl's vLLM rollout runs): one greedy and n sampled
    completions per prompt, seeded per chunk."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, seed=seed)
    greedy = llm.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=st["max_tokens"]))
    params = SamplingParams(
        n=st["n"], temperature=st["temperature"], top_p=st["top_p"], max_tokens=st["max_tokens"], seed=seed
    )
    sampled = llm.generate(prompts, params)
    return [o.outputs[0].text for o in greedy], [c.text for o in sampled for c in o.outputs]


def score_rows(module, exs: list, greedy: list[str], sampled: list[str], st: dict, *, model: str, bench: str) -> list:
    """Per-problem rows (evals.jsonl schema) from texts: greedy (P,), sampled (P * n,) prompt-major."""
    n = st["n"]
    return [
        {
            "iteration": int(st["iteration"]),
            "model": model,
            "benchmark": bench,
            "problem_id": str(ex.id),
            "n": n,
            "n_correct": sum(int(module.evaluate(ex, s)) for s in sampled[i * n : (i + 1) * n]),
            "greedy_correct": int(module.evaluate(ex, greedy[i])),
        }
        for i, ex in enumerate(exs)
    ]


def pick_engine(engine: str, module) -> str:
    """auto -> vllm when it is installed and a GPU is present (single-turn tasks), else hf; vllm where it is not
    installed is refused (UserError), before any work."""
    tools, installed = bool(getattr(module, "STOP_STRINGS", ())), importlib.util.find_spec("vllm") is not None
    if engine == "vllm" and tools:
        raise UserError(f"--engine vllm evaluates single-turn tasks; {module.NAME} uses tools: --engine hf")
    if engine == "vllm" and not installed:
        raise UserError(
            "--engine vllm: vLLM is not installed here; install verl's vLLM stack (cluster/gpu-install.sh, "
            "docs/scaling-out.md), or evaluate with --engine hf"
        )
    if engine != "auto":
        return engine
    return "vllm" if installed and not tools and torch.cuda.is_available() else "hf"


# ---------------------------------------------------------------- the command
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="emapg eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="a run directory, a checkpoints/iter_N directory or a Hugging Face model directory")
    ap.add_argument("--task", help="the task (default: the run's task.name; needed for a model directory)")
    ap.add_argument("--benchmarks", help="comma-separated (default: the task's benchmarks, else its test split)")
    ap.add_argument("--protocol", default="readme", help=f"{' | '.join(PROTOCOLS)} (default: readme)")
    ap.add_argument("--n", type=int, help="samples per problem (default: the protocol's)")
    ap.add_argument("--temperature", type=float, help="sampling temperature (default: the protocol's)")
    ap.add_argument("--top-p", type=float, dest="top_p", help="nucleus sampling mass (default: the protocol's)")
    ap.add_argument("--max-tokens", type=int, dest="max_tokens", help="response budget (default: the protocol's)")
    ap.add_argument("--limit", type=int, help="evaluate the first N problems of each benchmark only")
    ap.add_argument("--batch", type=int, default=8, help="problems per chunk (one write, one seed) (default: 8)")
    ap.add_argument("--engine", default="auto", help=f"{' | '.join(ENGINES)} (default: auto)")
    ap.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto, for --engine hf (default: auto)")
    ap.add_argument("--out", help="where evals.jsonl goes (default: <run_dir>/evals/<protocol>[_iter_N])")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Every option's value, before any work (one line naming it)."""
    if args.protocol not in PROTOCOLS:
        raise UserError(f"--protocol {args.protocol!r} is not a protocol; allowed: {', '.join(PROTOCOLS)}")
    if args.engine not in ENGINES:
        raise UserError(f"--engine {args.engine!r}; allowed: {', '.join(ENGINES)}")
    for opt, value, ok, rule in (
        ("--n", args.n, lambda v: v >= 1, "an integer >= 1"),
        ("--max-tokens", args.max_tokens, lambda v: v >= 1, "an integer >= 1"),
        ("--limit", args.limit, lambda v: v >= 1, "an integer >= 1"),
        ("--batch", args.batch, lambda v: v >= 1, "an integer >= 1"),
        ("--temperature", args.temperature, lambda v: v > 0, "a number > 0"),
        ("--top-p", args.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ):
        if value is not None and not ok(value):
            raise UserError(f"{opt}={value} must be {rule}")


def task_of(args: argparse.Namespace, t: Target) -> tuple[Any, DictConfig]:
    """(task module, task config): the run's task, or --task with the schema's defaults for a model dir."""
    name = args.task or (t.cfg.task.name if t.cfg is not None else None)
    if name is None:
        raise UserError(f"TARGET {t.path} is a model directory: give --task ({', '.join(sorted(TASKS))})")
    if name not in TASKS:
        raise UserError(f"--task {name!r} is not a task; allowed: {', '.join(sorted(TASKS))}")
    if t.cfg is not None and name != t.cfg.task.name:
        raise UserError(f"--task {name!r} differs from the run's task.name {t.cfg.task.name!r}")
    task_cfg = t.cfg.task if t.cfg is not None else OmegaConf.merge(OmegaConf.structured(TaskConfig), {"name": name})
    return TASKS[name], task_cfg


def pick_benchmarks(args: argparse.Namespace, module, task: str) -> list[str]:
    allowed = [*getattr(module, "BENCHMARKS", ()), task]  # and its own test split, named as the task
    given = [b.strip() for b in (args.benchmarks or "").split(",") if b.strip()]
    if bad := [b for b in given if b not in allowed]:
        raise UserError(f"--benchmarks: unknown benchmark {bad[0]!r} of task {task}; allowed: {', '.join(allowed)}")
    return given or list(getattr(module, "BENCHMARKS", ())) or [task]


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    check_args(args)
    t = resolve_target(args.target)
    module, task_cfg = task_of(args, t)
    benches = pick_benchmarks(args, module, task_cfg.name)
    st = settings(args, t, task_cfg.name, benches, pick_engine(args.engine, module))
    problem_sets = {b: problems(module, task_cfg, b, args.limit) for b in benches}  # a missing file: named here
    out = out_dir(args, t)
    with records.eval_dir(out, st) as rows:  # one writer per evaluation directory
        done = {(r["model"], r["benchmark"], r["problem_id"]) for r in rows}
        loaders = model_loaders(t)
        total = len(loaders) * sum(len(v) for v in problem_sets.values())
        bar = progress.bar(total, f"eval {t.path.name}", unit="problem")
        bar.update(sum(1 for m in loaders for b, exs in problem_sets.items() for e in exs if (m, b, str(e.id)) in done))
        kw = dict(module=module, task_cfg=task_cfg, run_cfg=t.cfg, problem_sets=problem_sets, st=st, out=out, done=done)
        try:
            for name, load in loaders.items():
                run_model(name, load, device=args.device, bar=bar, **kw)
        finally:
            bar.close()
        summary = summarize(records.read_evals(out), st)
        records.write_eval_summary(out, summary)
    print(format_summary(summary, out))
    return 0


def _generation_context(module, task_cfg: DictConfig, run_cfg: DictConfig | None) -> tuple[Any, dict]:
    """(tool environment or None, rollout keywords): as the run trained, for a tool task (the schema's defaults for
    a model directory)."""
    ro = run_cfg.rollout if run_cfg is not None else OmegaConf.structured(RolloutConfig)
    if not getattr(module, "STOP_STRINGS", ()):
        return None, {}
    if task_cfg.get("retriever_url"):
        env = ToolEnvAdapter(module, HTTPRetriever(task_cfg.retriever_url))
    else:
        env = ToolEnvAdapter(module, module.make_env(**OmegaConf.to_container(task_cfg.knobs, resolve=True)))
    return env, {"max_turns": int(ro.max_turns), "max_obs_tokens": int(ro.max_obs_tokens)}


def run_model(
    name, load, *, module, task_cfg, run_cfg, problem_sets: dict, st: dict, out: Path, done: set, bar, device
) -> None:
    """Evaluate one model on every benchmark, chunk by chunk, skipping the chunks already written."""
    env, rollout_kw = _generation_context(module, task_cfg, run_cfg)
    generate = None  # (prompts, st, seed) -> (greedy, sampled), once the model is loaded
    for bench, exs in problem_sets.items():
        for c in range(0, len(exs), st["batch"]):
            todo = [e for e in exs[c : c + st["batch"]] if (name, bench, str(e.id)) not in done]
            if not todo:
                continue
            if generate is None:
                model, tok = load()
                if st["engine"] == "vllm":  # vLLM reads a model directory
                    model.save_pretrained(out / ".hf" / name)
                    tok.save_pretrained(out / ".hf" / name)
                    generate = partial(vllm_samples, str(out / ".hf" / name))
                else:
                    model = model.to(resolve_device(device)).eval()
                    generate = partial(hf_samples, model, tok, env=env, rollout_kw=rollout_kw)
            seed = chunk_seed(st["seed"], name, bench, c // st["batch"])
            greedy, sampled = generate([module.prompt(e) for e in todo], st, seed)
            records.append_eval_rows(out, score_rows(module, todo, greedy, sampled, st, model=name, bench=bench))
            bar.update(len(todo))


def summarize(rows: list[dict], st: dict) -> dict:
    """Settings + {model: {benchmark: {problems, acc, pass@k for k = 1, 2, 4, ... <= n}}}."""
    ks = [k for k in (2**i for i in range(12)) if k <= st["n"]]
    results: dict[str, dict] = {}
    for r in rows:
        results.setdefault(r["model"], {}).setdefault(r["benchmark"], []).append(r)
    for by_bench in results.values():
        for b, rs in by_bench.items():
            by_bench[b] = {
                "problems": len(rs),
                "acc": sum(r["greedy_correct"] for r in rs) / len(rs),
                **{f"pass@{k}": sum(pass_at_k(r["n"], r["n_correct"], k) for r in rs) / len(rs) for k in ks},
            }
    return {"settings": st, "results": results}


def format_summary(summary: dict, out: Path) -> str:
    lines = [f"wrote {out / records.EVALS} and {out / records.EVAL_SUMMARY}"]
    for model, by_bench in summary["results"].items():
        for bench, res in by_bench.items():
            cells = "  ".join(f"{k} {v:.4f}" for k, v in res.items() if k != "problems")
            lines.append(f"{model:7s} {bench:16s} {res['problems']:5d} problems  {cells}")
    return "\n".join(lines)
