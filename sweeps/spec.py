"""Sweep specs: load and validate a sweep YAML before any trial starts. Pure: never imports ray.

    spec = load("sweeps/quickstart.yaml")   # SpecError (a ValueError) naming the key and the allowed values
    rows = trials(spec)                     # one dict per trial, in launch order: seeds x grid points
    print(table(spec))                      # what `emapg sweep X.yaml --dry-run` prints
    spec.overrides_for(point, seed)         # the Hydra overrides of one trial (experiments.build.compose)
    schema()                                # the JSON Schema of a sweep YAML (`emapg sweep --schema`)

A sweep YAML's keys, with an example of each: docs/sweeps.md, "Every key"; their types, ranges and defaults are
the typed models of sweeps/model.py (``SweepFile``, ``SPEC_DEFAULTS``), also the JSON Schema (sweeps/schema.json).

What is refused (one line naming the field path, ``experiments.errors.validation_line``): docs/sweeps.md, "Every
key". ``check`` composes every grid point / choice and both ends of every range against the config tree.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import math
import re
import shlex
from dataclasses import is_dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

# hydra_value, SPEC_DEFAULTS and SPEC_KEYS are read from here (sweeps.spec is the package's front)
from ema_pg_core.overrides import hydra_value  # noqa: F401
from experiments.errors import UserError, shown, validation_line
from experiments.user_yaml import NoAliasLoader, read
from sweeps.adaptive import levels, plan_text
from sweeps.model import SPEC_DEFAULTS, SPEC_KEYS, Param, Spec, SweepFile, grid_points  # noqa: F401

# The one list of the keys every run logs (docs/run-record.md), kept by hand: one iteration of the local trainer logs
# exactly these + the Top-k telemetry, its evaluation EVAL_METRICS per task (tests/core/test_local.py checks both).
RUN_METRICS = tuple(
    f"{ns}/{key}"
    for ns, keys in (
        ("train", "reward reward_std response_len len_capped turns entropy lr grad_norm"),
        ("loss", "pg total clip_frac dual_clip_frac approx_kl ratio_mean"),
        ("kl", "value"),
        ("anchor", "drift dist num_updates updated"),
        ("perf", "tokens_per_s iter_s rollout_s reward_s logprob_s update_s anchor_s"),
    )
    for key in keys.split()
)
EVAL_METRICS = ("acc", "pass@1")
MAX_FULL_PRODUCT = 64  # compose every combination up to this many; beyond it, one knob at a time
VOCAB_KEYS = ("experiment", "algo", "model", "algo.kl.type", "algo.kl.k")  # (+ model.*) decide k vs the vocabulary
_ABSENT = object()
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


class SpecError(ValueError):
    """An invalid sweep spec; the message names the offending key and the allowed values."""


# ---------------------------------------------------------------------------- loading
class UniqueKeyLoader(NoAliasLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (at any depth), and every alias."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: {...}` may be overridden, as YAML intends
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if first is not None:
                raise SpecError(
                    f"duplicate key {key} at lines {first} and {line}; YAML would keep only the last, so give it once"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load(path: str | Path, check_config: bool = True) -> Spec:
    """Read and validate a sweep YAML; errors are prefixed with the file name."""
    try:
        return parse(read(path, "sweep spec", UniqueKeyLoader), check_config=check_config)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None
    except UserError as e:  # missing, a directory, not text, not YAML, an alias (the message names the file)
        raise SpecError(str(e)) from None


def read_raw(path: str | Path) -> dict:
    """A sweep YAML's mapping as written, not validated (a sweep directory's sweep.yaml: what --resume compares the
    spec with); SpecError naming the file when it is missing, not YAML, cut short, or not a mapping."""
    try:
        data = read(path, "sweep spec", UniqueKeyLoader)
    except (SpecError, UserError) as e:  # not text, not YAML, an alias, a duplicate key (the message names the file)
        raise SpecError(str(e) if str(e).startswith(str(path)) else f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: is empty" if data is None else f"{path}: not a mapping (got {shown(data, 60)})")
    return data


def parse(data: Any, check_config: bool = True) -> Spec:
    """Validate a loaded YAML mapping into a Spec (and against the config tree unless told not to)."""
    try:
        spec = Spec.of(SweepFile.model_validate(data), data)
    except ValidationError as e:
        raise SpecError(validation_line(e, schema(), root="the spec")) from None
    if spec.backend == "verl" and "resources" in data:
        raise SpecError(
            "resources: a verl trial reserves its whole verl job, computed from the trial's config (one bundle of "
            "3 CPUs + 1 GPU per rank, trainer.nnodes x n_gpus_per_node, and the TaskRunner's); remove resources"
        )
    _check_search(spec)
    _check_adaptive(spec)
    _check_size(spec)
    return check(spec) if check_config else spec


@functools.cache
def schema() -> dict:
    """The JSON Schema of a sweep YAML (`emapg sweep --schema`; sweeps/schema.json): the models' own."""
    return {"$schema": JSON_SCHEMA_DIALECT, **SweepFile.model_json_schema()}


def _check_adaptive(spec: Spec) -> None:
    """Adaptive seeds need a grid search without early stopping, and compare.key/baseline from the space."""
    a = spec.adaptive
    if a is None:
        return
    key, baseline = a.compare.key, a.compare.baseline
    if spec.search != "grid" or spec.scheduler.type != "none":
        raise SpecError(
            "seeds.adaptive needs search: grid and scheduler: none (every trial must finish to be paired); "
            f"got search: {spec.search}, scheduler: {spec.scheduler.type}"
        )
    grid = {p.keys[0]: p for p in spec.space if p.kind == "grid" and len(p.keys) == 1}
    if key not in grid:
        raise SpecError(
            f"seeds.adaptive.compare.key={shown(key)} is not a single-key grid entry of space; "
            f"allowed: {', '.join(grid)}"
        )
    values = grid[key].values
    if baseline not in values or len(values) < 2:
        raise SpecError(
            f"seeds.adaptive.compare.baseline={shown(baseline)} must be one of space.{key}'s values "
            f"{shown(list(values))} (which need at least one other value to compare)"
        )
    if not any(levels(spec).values()):
        from analysis.stats import min_seeds  # loads numpy, pandas

        raise SpecError(
            f"seeds.adaptive.max={a.max} is too few seeds to decide anything at confidence {a.confidence:g}: the exact "
            f"paired test needs max >= {min_seeds(1 - a.confidence)} (more where start/step split it over looks)"
        )


def _check_search(spec: Spec) -> None:
    if spec.backend == "verl" and spec.scheduler.type != "none":
        raise SpecError(
            f"scheduler: {spec.scheduler.type} stops trials mid-run, and stopping a verl trial's job early "
            "(its Ray workers and GPUs released) is untested (docs/scaling-out.md); use scheduler: none "
            "with backend: verl"
        )
    if "seeds" in spec.raw and spec.seed_axis == (None,):
        raise SpecError("`seed` is in space and `seeds` is given; use one of them")
    if spec.search == "grid":
        bad = [p for p in spec.space if p.kind != "grid"]
        if bad:
            raise SpecError(
                f"space.{bad[0].name}: {bad[0].kind} needs search: random or optuna; "
                f"search: grid takes only grid entries"
            )
        if spec.num_samples != 1:
            raise SpecError("budget.num_samples must be 1 with search: grid (repeat points with `seeds`)")
    if spec.search == "optuna":
        bad = [p for p in spec.space if p.kind == "grid"]
        if bad:
            raise SpecError(
                f"space.{bad[0].name}: grid is not supported by search: optuna; use choice (or search: grid/random)"
            )


def _check_size(spec: Spec) -> None:
    """Refuse more than max_trials trials, counted from the axis sizes (before any enumeration)."""
    n = spec.num_trials
    if n <= spec.max_trials:
        return
    factors = [str(len(p.values)) for p in spec.space if p.kind == "grid"]
    if spec.seed_axis != (None,):
        factors.append(f"{len(spec.seeds)} seed{'s' * (len(spec.seeds) > 1)}")
    if spec.search != "grid":
        factors.append(f"{spec.num_samples} sample{'s' * (spec.num_samples > 1)}")
    what, narrow = ("grid", "the grid") if spec.search == "grid" else ("sweep", "the space or budget.num_samples")
    raise SpecError(
        f"the {what} has {n:,} trials ({' x '.join(factors)}), over max_trials={spec.max_trials}; "
        f"narrow {narrow} or raise max_trials"
    )


# ---------------------------------------------------------------------------- against the config tree
def check(spec: Spec) -> Spec:
    """Validate a spec against the composed config; fills scheduler.max_t. Imports experiments (not ray)."""
    from experiments import build  # loads omegaconf, numpy

    groups = build.group_options()  # config groups and their options (every registered task included)
    if spec.experiment is None and not any("experiment" in p.keys for p in spec.space):
        raise SpecError(f"base.experiment is required (allowed: {', '.join(build.presets())})")
    if spec.experiment is not None and spec.experiment not in build.presets():
        raise SpecError(
            f"base.experiment={shown(spec.experiment)} is not a preset; allowed: {', '.join(build.presets())}"
        )
    plain = build.compose([f"experiment={spec.experiment}"] if spec.experiment else [])
    for key, value in spec.overrides.items():
        _check_key(f"base.overrides.{key}", key, groups, [value], plain)
    base = _compose(build, spec, {}, None, "base")
    for p in spec.space:
        for i, key in enumerate(p.keys):
            vals = [v[i] for v in p.values] if len(p.keys) > 1 else list(p.values)
            node = _check_key(f"space.{p.name}", key, groups, vals if p.kind in ("grid", "choice") else [], base)
            if p.kind in ("uniform", "loguniform") and isinstance(node, int) and not isinstance(node, bool):
                raise SpecError(f"space.{p.name}: {key} is an integer; use int: [low, high]")
            if p.kind in ("uniform", "loguniform", "int") and (
                isinstance(node, bool) or not isinstance(node, (int, float))
            ):
                raise SpecError(f"space.{p.name}: {key}={shown(node)} is not numeric; use grid or choice")
    iterations, tasks = set(), set()
    for point in _check_points(spec.space):
        where = "space point " + ", ".join(f"{k}={v}" for k, v in point.items())
        cfg = _compose(build, spec, point, spec.seed_axis[0], where)
        iterations.add(int(cfg.trainer.iterations))
        tasks.add(str(cfg.task.name))
    _check_metric(spec.metric, tasks)
    if spec.adaptive and spec.adaptive.metric:
        _check_metric(spec.adaptive.metric, tasks)
    _check_vocab(build, spec)
    s = spec.scheduler
    if s.type == "asha":
        max_t = s.max_t or max(iterations)
        if s.grace_period > max_t:
            raise SpecError(f"scheduler.grace_period={s.grace_period} exceeds max_t={max_t} (trainer.iterations)")
        spec = replace(spec, scheduler=s.model_copy(update={"max_t": max_t}))
    return spec


def _check_key(where: str, key: str, groups: dict, values: list, base):
    """Raise unless `key` is a config group (values among its options) or a leaf of the base config."""
    if key in groups:
        bad = [v for v in values if v not in groups[key]]
        if bad:
            raise SpecError(f"{where}: {shown(bad[0])} is not a {key} option; allowed: {', '.join(groups[key])}")
        return None
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.select(base, key, default=_ABSENT, throw_on_missing=False)
    if node is _ABSENT:
        near = difflib.get_close_matches(key, _leaves(OmegaConf.to_container(base)) + list(groups), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(near)}?" if near else f"; config groups: {', '.join(groups)}"
        raise SpecError(f"{where}: unknown config key {shown(key)}{hint}")
    if isinstance(node, DictConfig) and is_dataclass(OmegaConf.get_type(node)):  # a section, not a dict value
        raise SpecError(
            f"{where}: {key} is a config section; vary one of its keys: {', '.join(f'{key}.{k}' for k in node)}"
        )
    return node


def _leaves(cfg, prefix: str = "") -> list[str]:
    """Every leaf key of a config, dotted (for "did you mean")."""
    out = []
    for k, v in cfg.items() if isinstance(cfg, dict) else ():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def _check_points(space: tuple[Param, ...]):
    """Points whose composition validates every listed value and range end (the full product if small)."""
    axes = [[p.assign(v) for v in p.values] for p in space]  # every listed value, or both ends of a range
    if math.prod(len(a) for a in axes) <= MAX_FULL_PRODUCT:
        for combo in itertools.product(*axes):
            yield {k: v for part in combo for k, v in part.items()}
        return
    first = {k: v for a in axes for k, v in a[0].items()}
    for a in axes:
        for part in a:
            yield {**first, **part}


def _check_vocab(build, spec: Spec) -> None:
    """Refuse a Top-k KL whose algo.kl.k exceeds its model's vocabulary: the largest k is composed with every
    estimator and model the space can pick (the vocabulary is read from the model's config, no weights loaded)."""
    for point in _check_points(_vocab_space(spec.space)):
        where = "trials with " + ", ".join(f"{k}={v}" for k, v in point.items()) if point else "every trial"
        cfg = _compose(build, spec, point, spec.seed_axis[0], where)
        try:
            build.check_k(cfg)
        except ValueError as e:
            raise SpecError(f"{where}: {e}") from None


def _vocab_space(space: tuple[Param, ...]) -> tuple[Param, ...]:
    """The entries deciding a trial's k, KL estimator and model; algo.kl.k alone only at its largest value."""
    out = []
    for p in space:
        if p.keys == ("algo.kl.k",):
            out.append(Param(p.keys, "grid", (max(p.values),)))
        elif any(k in VOCAB_KEYS or k.startswith("model.") for k in p.keys):
            out.append(p)
    return tuple(out)


def _compose(build, spec: Spec, point: dict, seed, where: str):
    try:
        cfg = build.compose(spec.overrides_for(point, seed))
        build.validate(cfg)
    except ValueError as e:  # a bad value or key (build.compose words Hydra's errors as UserError)
        raise SpecError(re.sub(r"\s+", " ", f"{where}: {e}")) from None
    return cfg


def _check_metric(metric: str, tasks: set[str]) -> None:
    from experiments.tasks import TASKS  # loads numpy

    key = metric.removeprefix("best_")
    # a task logs eval/<task>/<m> (on the verl backend: the mean over its benchmarks) and, when it has
    # several evaluation sets, eval/<benchmark>/<m> for each (experiments.verl_metrics)
    per_task = {
        t: {
            f"{ns}/{b}/{m}"
            for ns in ("eval", "eval_anchor")
            for b in (*getattr(TASKS.get(t), "BENCHMARKS", ()), t)
            for m in EVAL_METRICS
        }
        for t in tasks
    }
    allowed = set(RUN_METRICS) | set.intersection(*per_task.values())
    if key in allowed:
        return
    missing = [t for t, keys in per_task.items() if key not in keys]
    if key.startswith(("eval/", "eval_anchor/")) and missing and len(missing) < len(tasks):
        raise SpecError(
            f"metric={shown(metric)} is not logged by trials with task {', '.join(sorted(missing))}; a sweep over "
            "several tasks must optimise a metric every task logs (e.g. train/reward), or be split per task"
        )
    near = difflib.get_close_matches(key, sorted(allowed), n=3, cutoff=0.5)
    raise SpecError(
        f"metric={shown(metric)} is not a metric the runs log (docs/run-record.md)"
        + (f"; did you mean {', '.join(near)}?" if near else "")
        + f" Allowed: {', '.join(sorted(allowed))}, each also as best_<key>"
    )


# ---------------------------------------------------------------------------- trials and the table
def trials(spec: Spec) -> list[dict[str, Any]]:
    """One row per trial, in launch order: for each seed every grid point. Sampled entries (random,
    optuna) show their distribution."""
    sampled = {p.name: p.describe() for p in spec.space if p.kind != "grid"}
    points = grid_points(spec)
    rows = []
    for sample, seed, point in itertools.product(range(spec.num_samples), spec.seed_axis, points):
        row = {**point, **sampled}
        if seed is not None:
            row["seed"] = seed
        if spec.search != "grid":
            row["sample"] = sample
        rows.append(row)
    return rows


def table(spec: Spec) -> str:
    """The dry-run view: the settings, every trial (adaptive seeds: those of the first round, and the plan),
    and the exact overrides of the first one."""
    rows = trials(spec)
    n = len(rows)  # with adaptive seeds: the worst case, every point at `max` seeds
    if spec.adaptive:
        rows = [r for r in rows if r["seed"] - spec.adaptive.first < spec.adaptive.start]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(i)] + [_fmt(r.get(c, "")) for c in cols] for i, r in enumerate(rows)]
    widths = [max(len(x) for x in col) for col in zip(["#"] + cols, *cells)]
    line = lambda xs: "  ".join(x.ljust(w) for x, w in zip(xs, widths)).rstrip()  # noqa: E731
    s = spec.scheduler
    sched = "none"
    if s.type == "asha":
        sched = f"asha (grace_period={s.grace_period}, reduction_factor={s.reduction_factor:g}, max_t={s.max_t})"
    first = {k: v for k, v in rows[0].items() if k not in ("seed", "sample") and not str(v).startswith("~")}
    per_trial = f"{spec.cpu:g} CPU {spec.gpu:g} GPU"
    if spec.backend == "verl":
        per_trial = "its verl job (a placement group of one 3-CPU + 1-GPU bundle per rank, from the trial's config)"
    head = [
        f"sweep {spec.name}: {n} trials{' at most' if spec.adaptive else ''}, search={spec.search}"
        + (f" (seed {spec.search_seed})" if spec.search != "grid" else ""),
        f"  metric {spec.metric} ({spec.mode}); scheduler {sched}; health "
        + (" ".join(f"{k[len('health.') :]}={v}" for k, v in spec.health.items()) or "non-finite loss/gradient only"),
        f"  per trial {per_trial}; max_concurrent {spec.max_concurrent or 'unlimited'}; "
        f"max_failures {spec.max_failures}; backend {spec.backend}"
        + (f"; time budget {spec.time_budget_s:g}s" if spec.time_budget_s else ""),
        "",
        line(["#"] + cols),
        line(["-" * w for w in widths]),
        *map(line, cells),
        "",
        "trial 0 runs: emapg train " + " ".join(map(shlex.quote, spec.overrides_for(first, rows[0].get("seed")))),
    ]
    if spec.adaptive:
        head[3:3] = ["", plan_text(spec)]
    return "\n".join(head)


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(list(v) if isinstance(v, tuple) else v)
