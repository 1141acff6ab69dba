"""Staged runs: one run trained in stages, each continuing the previous stage's last checkpoint.

    emapg train experiment=math_deepscaler_ema_pg stages=[8k,16k]     # the task's stages, one command
    emapg train experiment=math_deepscaler_ema_pg stage=16k           # the task's stages up to 16k
    emapg train experiment=math_tiny_ema_pg \\
        'stages=[{name: short, set: {trainer.iterations: 20}}, {name: long, set: {trainer.iterations: 40,
                 rollout.max_new_tokens: 24}}]'                        # any preset: stages given in full
    emapg train ... run_dir=<dir> resume=true                         # continue: finished stages are skipped,
                                                                      # the current one resumes mid-stage

A stage is a name and the config keys it sets on top of the run's config (`Stage.overrides`,
dotted keys). A name alone is one of the task's `STAGES` (its module's `stage_overrides(name)`,
e.g. the paper's 8k/16k/24k math schedule); `{name, set}` adds or overrides keys. A list under
`backend.verl.overrides` is appended to the run's own (a verl key given again replaces the run's).

`trainer.iterations` is where a stage ends, counted from the start of the whole run, so the
stages' ends must increase. All stages write one run record (docs/run-record.md, `stages.jsonl`). Every stage
after the first continues the record like a resume that may also change its stage's keys, and its trainer starts
from the previous stage's last checkpoint: the local backend's `checkpoints/iter_N` (policy, EMA anchor
with its update count, optimizer, data position), verl's `global_step_N` (actor, and the anchor
beside it) through `trainer.resume_mode=resume_path`.

`stage=<name>` stops after that stage; a later command with `resume=true` and a later `stage`
continues. `stage=<name> resume_from=<checkpoint>` starts that stage from a checkpoint trained
elsewhere (the stages before it are not run).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments import records
from experiments.backends.verl.launch import checkpoint_root
from experiments.errors import UserError
from experiments.tasks import get_task
from experiments.verl_metrics import attempt_files, read_attempts, trained_step

VERL_OVERRIDES = "backend.verl.overrides"


@dataclass(frozen=True)
class Stage:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted config keys set on top of the run's config


def entry_stage(entry: Any, module, where: str) -> Stage:
    """One `stages` entry -> Stage: a name of the task's STAGES, or {name, set} (set: nested or dotted keys, on top
    of the task's own stage of that name, if it has one)."""
    named = isinstance(entry, str)  # a name alone must be one of the task's stages
    if named:
        entry = {"name": entry}
    elif not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or set(entry) - {"name", "set"}:
        raise UserError(f"{where}={entry!r}: a stage is a name of the task's stages or {{name: ..., set: {{...}}}}")
    sets = entry.get("set") or {}
    if not isinstance(sets, Mapping):
        raise UserError(f"{where}.set={sets!r}: expected a mapping of config keys to values")
    known = list(getattr(module, "STAGES", {}) or {})
    if named and entry["name"] not in known:
        allowed = ", ".join(known) if known else "none: give each stage as {name: ..., set: {key: value}}"
        raise UserError(f"{where}={entry['name']!r} is not a stage of task {module.NAME}; its stages: {allowed}")
    base = dict(module.stage_overrides(entry["name"])) if entry["name"] in known else {}
    return Stage(entry["name"], {**base, **records.flat(dict(sets))})


def plan(cfg: DictConfig) -> list[Stage]:
    """The stages to run, in order, up to and including `cfg.stage` (all when it is null)."""
    module = get_task(cfg.task.name)
    entries = OmegaConf.to_container(cfg.stages, resolve=True) if cfg.stages else getattr(module, "STAGES", {})
    stages = [entry_stage(e, module, f"stages[{i}]") for i, e in enumerate(entries)]
    names = [s.name for s in stages]
    if not stages:
        raise UserError(f"stage={cfg.stage!r}: task {module.NAME} has no stages; give them with stages=[...]")
    if len(set(names)) < len(names):
        raise UserError(f"stages: duplicate stage names in {names}")
    if cfg.stage is not None and cfg.stage not in names:
        raise UserError(f"stage={cfg.stage!r} is not one of the stages; allowed: {', '.join(names)}")
    return stages[: names.index(cfg.stage) + 1] if cfg.stage is not None else stages


def apply(cfg: DictConfig, stage: Stage) -> DictConfig:
    """`cfg` with the stage's keys set (a list under backend.verl.overrides appended) and `stage` named."""
    out = copy.deepcopy(cfg)  # keeps the schema's types (the dataclasses validate every stage)
    for key, value in stage.overrides.items():
        if key == VERL_OVERRIDES:
            value = merge_verl_overrides(list(OmegaConf.select(cfg, key) or []), list(value))
        try:
            OmegaConf.update(out, key, value, merge=False)
        except Exception as e:  # noqa: BLE001  an unknown key or a value of the wrong type, named
            raise UserError(f"stage {stage.name!r}: cannot set {key}={value!r} ({type(e).__name__})") from None
    OmegaConf.update(out, "stage", stage.name, merge=False)
    return out


def merge_verl_overrides(base: list[str], extra: list[str]) -> list[str]:
    """`base` + `extra`, without the base's entries for a key `extra` sets again (verl sees each key once)."""
    again = {e.split("=", 1)[0].lstrip("+~") for e in extra}
    return [b for b in base if b.split("=", 1)[0].lstrip("+~") not in again] + extra


def stage_configs(cfg: DictConfig, validate: Callable[[DictConfig], Any]) -> list[tuple[Stage, DictConfig]]:
    """(stage, its config) for each stage to run, every config validated and the ends increasing, before
    any work."""
    out, end = [], None
    for stage in plan(cfg):
        scfg = apply(cfg, stage)
        validate(scfg)
        if end is not None and int(scfg.trainer.iterations) <= end:
            raise UserError(
                f"stage {stage.name!r} ends at trainer.iterations={scfg.trainer.iterations}, not after the "
                f"previous stage ({end}); set its end: {{name: {stage.name}, set: {{trainer.iterations: N}}}}"
            )
        end = int(scfg.trainer.iterations)
        out.append((stage, scfg))
    return out


def start_info(stage: Stage, index: int, previous: DictConfig | None, base: DictConfig) -> dict:
    """What RunRecord.create and the backends need to start `stage`: its name, index, the keys it may
    change, and where its trainer continues from (previous stage's last iteration, or resume_from)."""
    return {
        "stage": stage.name,
        "index": index,
        "may_change": (*stage.overrides, "stage"),
        "resume_from": base.resume_from,
        "previous_end": int(previous.trainer.iterations) if previous is not None else None,
    }


def verl_resume_overrides(run: Mapping[str, Any], start: Mapping[str, Any] | None) -> list[str]:
    """verl overrides that make a stage's first attempt start from the previous stage's last checkpoint
    (``global_step_<previous end>``, actor and the anchor beside it) or from ``resume_from``; [] otherwise
    (a first stage, or a stage resumed mid-way: verl's resume_mode=auto finds its newest checkpoint)."""
    if start is None or (start.get("previous_end") is None and not start.get("resume_from")):
        return []
    path = start.get("resume_from") or os.path.join(checkpoint_root(run), f"global_step_{start['previous_end']}")
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={os.path.abspath(os.path.expanduser(path))}"]


def verl_logged_resume(run: Mapping[str, Any], run_dir: Path) -> list[str]:
    """verl overrides that resume a verl run from the newest checkpoint whose step verl also logged; [] when that is
    the newest checkpoint (verl's resume_mode=auto takes it).

    verl saves a step's checkpoint before it logs the step's metrics: an attempt killed between the two (a node lost,
    a driver killed) leaves a checkpoint of a step the run record never saw, and resuming from it would leave that
    step out of the record for good. Resuming from the step before trains it again and logs it (verl keeps the
    last ``trainer.keep_checkpoints`` >= 1 checkpoints; when the one needed is gone, [] and the step stays missing)."""
    root = Path(checkpoint_root(run))
    try:
        newest = int((root / "latest_checkpointed_iteration.txt").read_text().strip() or 0)
    except (OSError, ValueError):
        return []
    logged = max((s for s, m in read_attempts(attempt_files(run_dir)).items() if trained_step(m)), default=0)
    if newest <= logged:
        return []
    if logged == 0:
        return ["trainer.resume_mode=disable"]
    path = root / f"global_step_{logged}"
    if not (path / "actor").is_dir():
        return []
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={path.resolve()}"]


def run_staged(cfg: DictConfig, run_dir: Path, validate, run_one: Callable[[DictConfig, dict | None], dict]) -> dict:
    """Run the stages of `cfg` in `run_dir` (one record): finished ones skipped, an unfinished one resumed,
    the rest started from the previous stage's last checkpoint. Returns the last stage's summary."""
    if cfg.resume_from and cfg.stage is None:
        raise UserError("resume_from needs stage=<name>: the stage that starts from that checkpoint")
    planned = list(enumerate(stage_configs(cfg, validate)))  # (index, (stage, its config))
    done, current = records.stage_progress(run_dir) if cfg.resume else ([], None)
    if cfg.resume_from:  # a checkpoint of the run's backend, refused before any work otherwise
        path = Path(os.path.expanduser(str(cfg.resume_from)))
        if cfg.backend.name == "local" and not (path / "state.pt").is_file():
            raise UserError(
                f"resume_from={cfg.resume_from!r} is not a local checkpoint (checkpoints/iter_N with state.pt)"
            )
        if cfg.backend.name == "verl" and not (path / "actor").is_dir():
            raise UserError(f"resume_from={cfg.resume_from!r} is not a verl checkpoint (global_step_N with actor/)")
        planned, done = planned[-1:], []  # the earlier stages ran elsewhere
    summary, previous = {}, None
    for index, (stage, scfg) in planned:
        if stage.name in done:
            previous = scfg
            continue
        first = stage.name != current  # this stage has not started in run_dir yet
        transition = first and (index > 0 or bool(done))  # continues the previous stage's checkpoint
        resume = (cfg.resume or "auto") if transition else cfg.resume  # auto: a stage after resume_from starts
        scfg = OmegaConf.merge(scfg, {"run_dir": str(run_dir), "resume": resume})
        summary = run_one(scfg, start_info(stage, index, previous, cfg) if first else None)
        previous, current = scfg, None
    return summary
