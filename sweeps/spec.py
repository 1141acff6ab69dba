"""Sweep specs: load and validate a sweep YAML before any trial starts. Pure: never imports ray.

    spec = load("sweeps/quickstart.yaml")   # SpecError (a ValueError) naming the key and the allowed values
    rows = trials(spec)                     # one dict per trial, in launch order: seeds x grid points
    print(table(spec))                      # what `emapg sweep X.yaml --dry-run` prints
    spec.overrides_for(point, seed)         # the Hydra overrides of one trial (experiments.build.compose)

A sweep YAML (only `name`, `base` and `metric` are required). The values below are examples; every
default is a field default of `Spec` (and `Scheduler`, `Adaptive`) below, the one place `parse` reads them from
(``SPEC_DEFAULTS``):

    name: quickstart                  # directory name (outputs/sweeps/<name>) and W&B group; <= 58 characters
    base:
      experiment: math_tiny_grpo      # a preset of experiments/conf/experiment/
      overrides: {trainer.iterations: 20, logger: none}  # fixed config keys (and config groups)
    space:                            # config key -> exactly one of:
      experiment: {grid: [math_tiny_grpo, math_tiny_ema_pg]}  # grid: every value is run
      algo.kl.type: {choice: [k3, topk_reverse]}              # choice: sampled (random, optuna)
      algo.anchor.tau: {uniform: [0.8, 1.0]}                  # uniform / loguniform: [low, high], finite
      algo.anchor.period: {int: [1, 20]}                      # int: [low, high], both inclusive
      algo.kl.type,algo.kl.tail: {grid: [[k3, none], [topk_reverse, paper]]}  # keys varied together
    seeds: [0, 1, 2]                  # every point runs once per seed (or put `seed` in space), or adaptive:
    # seeds: {adaptive: {compare: {key: algo.anchor.tau, baseline: 1.0}, start: 3, step: 2, max: 11,
    #         stop_when: [ci_excludes_zero, {ci_width_below: 0.04}]}}   # more seeds only where unclear
    #         (sweeps/adaptive.py; the fields and defaults: `Adaptive`; needs search: grid, scheduler: none)
    #         every seed (and search.seed) is an integer in [0, 2**32 - 1] (ema_pg_core.config.SEED_MAX)
    search: {type: optuna, seed: 7}   # grid | random | optuna, or {type: ..., seed: the sampler's seed}
    scheduler: {type: asha, grace_period: 2}  # none | asha, or {type: asha, ...the Scheduler fields}
                                      # (max_t: null = trainer.iterations)
    metric: eval/math_tiny/acc        # a key the runs log (docs/run-record.md), or best_<key>
    mode: max                         # max | min
    budget: {num_samples: 4, time_budget_s: 3600}   # samples per seed (random/optuna); wall-clock cap
    resources: {cpu: 2, gpu: 0}       # per trial; a local trial sets trainer.threads to its CPUs
    max_concurrent: 4                 # trials at once (null: as many as the resources allow)
    backend: local                    # local | verl (a verl trial reserves its verl job; no `resources`)
    max_failures: 2                   # retries of a failing trial, each from its last checkpoint
    max_trials: 500                   # refuse a sweep of more trials (grid points x seeds x num_samples)
    health:                           # RL-health stops for every trial (the run config's health section,
      entropy_floor: {floor: 0.05, patience: 5}   # ema_pg_core/health.py); a rule that fires ends that
      kl_spike: {factor: 10}                      # trial only, as stopped_unhealthy. Non-finite loss or
                                                  # gradient always stops a trial.

A key given twice in one mapping is an error (plain YAML would keep the last), and so is any YAML alias
(``*name``; experiments.user_yaml: a few nested aliases can expand to billions of values). The trial count is
computed from the axis sizes before anything is enumerated; over `max_trials` the spec is refused.
Config keys are checked against the composed Hydra config (``experiments.build.compose``); a
config group (task, experiment, algo, ...) takes the group's option names. Every grid point /
choice, and both ends of every range, is composed and validated (``experiments.build.validate``).
A Top-k KL's largest ``algo.kl.k`` is checked against the vocabulary of every model and estimator
the space can pick (``experiments.build.vocab_size``: the model's config, no weights loaded).
"""

from __future__ import annotations

import difflib
import itertools
import math
import re
import shlex
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from ema_pg_core.overrides import hydra_value
from experiments.errors import UserError, shown
from experiments.user_yaml import NoAliasLoader, read

KINDS = ("grid", "choice", "uniform", "loguniform", "int")
SEARCHES = ("grid", "random", "optuna")
SCHEDULERS = ("none", "asha")
BACKENDS = ("local", "verl")
SET_BY_SWEEP = ("run_dir", "out_root", "resume", "sweep.name", "sweep.trial_id", "logger.group", "logger.tags")
# Keys every run logs (docs/run-record.md); eval keys are per task below. Both equal what one iteration
# of ema_pg_core.local.trainer logs (tests/core/test_local.py).
RUN_METRICS = (
    "train/reward",
    "train/reward_std",
    "train/response_len",
    "train/len_capped",
    "train/turns",
    "train/entropy",
    "train/lr",
    "train/grad_norm",
    "loss/pg",
    "loss/total",
    "loss/clip_frac",
    "loss/dual_clip_frac",
    "loss/approx_kl",
    "loss/ratio_mean",
    "kl/value",
    "anchor/drift",
    "anchor/dist",
    "anchor/num_updates",
    "anchor/updated",
    "perf/tokens_per_s",
    "perf/iter_s",
    "perf/rollout_s",
    "perf/reward_s",
    "perf/logprob_s",
    "perf/update_s",
    "perf/anchor_s",
)
EVAL_METRICS = ("acc", "pass@1")
MAX_FULL_PRODUCT = 64  # compose every combination up to this many; beyond it, one knob at a time
MAX_TRIALS = 10_000  # default `max_trials`: a larger sweep is refused before its trials are enumerated
VOCAB_KEYS = ("experiment", "algo", "model", "algo.kl.type", "algo.kl.k")  # (+ model.*) decide k vs the vocabulary
_ABSENT = object()


class SpecError(ValueError):
    """An invalid sweep spec; the message names the offending key and the allowed values."""


@dataclass(frozen=True)
class Param:
    """One space entry: `keys` (several when varied together) and their values or range."""

    keys: tuple[str, ...]
    kind: str
    values: tuple  # grid/choice: the values (tuples for joint keys); uniform/loguniform/int: (low, high)

    @property
    def name(self) -> str:
        return ",".join(self.keys)

    def assign(self, value) -> dict[str, Any]:
        """{config key: value} for one value of this entry."""
        return dict(zip(self.keys, value)) if len(self.keys) > 1 else {self.keys[0]: value}

    def describe(self) -> str:
        if self.kind == "grid":
            return f"grid{list(self.values)}"
        return (
            f"~choice{list(self.values)}"
            if self.kind == "choice"
            else f"~{self.kind}({self.values[0]}, {self.values[1]})"
        )


@dataclass(frozen=True)
class Scheduler:
    type: str = "none"
    grace_period: int = 1
    reduction_factor: float = 2.0
    time_attr: str = "training_iteration"
    max_t: int | None = None


@dataclass(frozen=True)
class Adaptive:
    """`seeds: {adaptive: ...}`: seeds added per comparison until its paired CI meets `stop_when` (sweeps.adaptive).

    Every value of the grid key `key` other than `baseline` is compared with `baseline` at the same values of the
    other keys. Round 0 runs seeds first .. first+start-1 everywhere; each later round adds `step` seeds to the
    comparisons whose rule is not met yet (and to their baseline), up to `max` seeds."""

    key: str  # compare.key: a grid key of space
    baseline: Any  # compare.baseline: one of its values
    start: int = 3
    step: int = 2
    max: int = 11
    first: int = 0  # the first seed; seeds are first, first+1, ...
    metric: str | None = None  # None = the sweep's metric; its final value (best_<key>: its best) is compared
    stop_when: tuple[tuple[str, float | None], ...] = (("ci_excludes_zero", None),)
    confidence: float = 0.95
    reps: int = 2000

    @property
    def seeds(self) -> tuple[int, ...]:
        """Every seed a comparison may use (the worst case)."""
        return tuple(range(self.first, self.first + self.max))


STOP_RULES = ("ci_excludes_zero", "ci_width_below")


@dataclass(frozen=True)
class Spec:
    """A validated sweep spec. The field defaults are the YAML's defaults (``SPEC_DEFAULTS``, read by
    ``parse``). Fields named unlike their YAML key: experiment, overrides = base.*; search_seed =
    search.seed; num_samples, time_budget_s = budget.*; cpu, gpu = resources.*."""

    name: str
    metric: str
    experiment: str | None = None
    overrides: dict = field(default_factory=dict)
    space: tuple[Param, ...] = ()
    seeds: tuple[int, ...] = (0,)
    search: str = "grid"
    search_seed: int | None = 0
    scheduler: Scheduler = Scheduler()
    mode: str = "max"
    num_samples: int = 1
    time_budget_s: float | None = None
    cpu: float = 1.0
    gpu: float = 0.0
    max_concurrent: int | None = None
    backend: str = "local"
    max_failures: int = 1
    max_trials: int = MAX_TRIALS
    adaptive: Adaptive | None = None  # `seeds: {adaptive: ...}`; then `seeds` holds every seed it may use
    health: dict = field(default_factory=dict)
    """`health:` as {dotted run-config key: value} (e.g. health.kl_spike.factor), set for every trial."""
    raw: dict = field(default_factory=dict, compare=False)
    """The YAML as loaded (written to <sweep_dir>/sweep.yaml; compared on --resume)."""

    def overrides_for(self, point: dict[str, Any], seed: int | None) -> list[str]:
        """Hydra overrides of one trial: base, the point, seed, and the sweep's bookkeeping keys."""
        exp = point.get("experiment", self.experiment)
        fixed = {k: v for k, v in {**self.health, **self.overrides, **point}.items() if k != "experiment"}
        if self.backend == "local" and "trainer.threads" not in fixed:
            fixed["trainer.threads"] = max(1, int(self.cpu))
        if seed is not None:
            fixed["seed"] = seed
        tags = [f"sweep:{self.name}"] + [f"{k.rsplit('.', 1)[-1]}={v}"[:64] for k, v in point.items()]
        fixed.update({"backend": self.backend, "sweep.name": self.name, "logger.group": self.name, "logger.tags": tags})
        # a dict value (e.g. task.knobs) is merged into the config's dict: Hydra's `++` adds keys in struct mode;
        # strings in double quotes: the dry-run line shell-quotes each override in single quotes
        text = {k: hydra_value(v, quote='"') for k, v in fixed.items()}
        return ([f"experiment={exp}"] if exp else []) + [
            f"{'++' if isinstance(v, dict) else ''}{k}={text[k]}" for k, v in fixed.items()
        ]

    @property
    def seed_axis(self) -> tuple:
        """Seeds every point is repeated over; (None,) when `seed` itself is in the space."""
        return (None,) if any("seed" in p.keys for p in self.space) else self.seeds

    @property
    def num_trials(self) -> int:
        """len(trials(self)), from the axis sizes alone (nothing enumerated)."""
        return math.prod(len(p.values) for p in self.space if p.kind == "grid") * len(self.seed_axis) * self.num_samples


SPEC_DEFAULTS = {f.name: f.default for f in fields(Spec) if f.default is not MISSING}
SPEC_DEFAULTS["seeds.adaptive"] = {f.name: f.default for f in fields(Adaptive) if f.default is not MISSING}
"""The default of every optional key, by Spec field (and of `seeds.adaptive`, by Adaptive field): the one home
``parse`` reads."""


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


SPEC_KEYS = (
    "name",
    "base",
    "space",
    "seeds",
    "search",
    "scheduler",
    "metric",
    "mode",
    "budget",
    "resources",
    "max_concurrent",
    "backend",
    "max_failures",
    "max_trials",
    "health",
)
"""The top-level keys of a sweep YAML."""


def parse(data: Any, check_config: bool = True) -> Spec:
    """Validate a loaded YAML mapping into a Spec (and against the config tree unless told not to)."""
    data = _mapping(data, "the spec")
    _known(data, SPEC_KEYS, "")
    for key in ("name", "base", "metric"):
        if key not in data:
            raise SpecError(f"`{key}` is required")
    name = _name(data["name"])
    base, overrides = _base(data["base"])
    budget = _sub_mapping(data, "budget", ("num_samples", "time_budget_s"))
    resources = _sub_mapping(data, "resources", ("cpu", "gpu"))
    if data.get("backend") == "verl" and "resources" in data:
        raise SpecError(
            "resources: a verl trial reserves its whole verl job, computed from the trial's config (one bundle of "
            "3 CPUs + 1 GPU per rank, trainer.nnodes x n_gpus_per_node, and the TaskRunner's); remove resources"
        )
    spec = _build(data, name, base, overrides, budget, resources)
    _check_search(spec)
    _check_adaptive(spec)
    _check_size(spec)
    return check(spec) if check_config else spec


NAME_MAX = 58
"""The longest sweep name: it names a directory and goes into every trial's W&B tag ``sweep:<name>``, which W&B
allows up to 64 characters."""


def _name(name) -> str:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or len(name) > NAME_MAX:
        raise SpecError(
            f"name={shown(name)} must be 1 to {NAME_MAX} letters, digits, '_', '.', '-' (it names a directory and the "
            f"W&B tag sweep:<name>, at most 64 characters)"
        )
    return name


def _base(value) -> tuple[dict, dict]:
    """`base` and its `overrides`, which may not set what the spec's own keys or the sweep set."""
    base = _mapping(value, "base")
    _known(base, ("experiment", "overrides"), "base.")
    overrides = _mapping(base.get("overrides") or {}, "base.overrides")
    for key in overrides:
        if key == "backend":
            raise SpecError("base.overrides.backend: use the spec's top-level `backend:` key")
        if key == "health" or key.startswith("health."):
            raise SpecError(f"base.overrides.{key}: use the spec's top-level `health:` key")
        if key in SET_BY_SWEEP or key == "seed":
            raise SpecError(
                f"base.overrides.{key}: set by the sweep itself" + (" (use `seeds: [...]`)" if key == "seed" else "")
            )
    return base, overrides


def _sub_mapping(data: dict, key: str, allowed: tuple[str, ...]) -> dict:
    """The optional mapping `data[key]` ({} if absent or null), with only `allowed` keys."""
    value = _mapping(data.get(key) or {}, key)
    _known(value, allowed, f"{key}.")
    return value


def _build(data: dict, name: str, base: dict, overrides: dict, budget: dict, resources: dict) -> Spec:
    """The Spec of the remaining keys, each validated, a missing one taken from ``SPEC_DEFAULTS``."""
    d = SPEC_DEFAULTS
    search, search_seed = _search(data.get("search", d["search"]))
    adaptive = _adaptive(data.get("seeds"))
    concurrent = data.get("max_concurrent", d["max_concurrent"])
    return Spec(
        name=name,
        metric=_metric_syntax(data["metric"]),
        experiment=base.get("experiment"),
        overrides=dict(overrides),
        space=_space(data.get("space"), overrides),
        seeds=_seeds(data.get("seeds", list(d["seeds"])), adaptive),
        adaptive=adaptive,
        search=search,
        search_seed=search_seed,
        scheduler=_scheduler(data.get("scheduler", d["scheduler"].type)),
        mode=_one_of("mode", data.get("mode", d["mode"]), ("max", "min")),
        num_samples=_int("budget.num_samples", budget.get("num_samples", d["num_samples"]), 1),
        time_budget_s=_number("budget.time_budget_s", budget.get("time_budget_s", d["time_budget_s"]), 0, none_ok=True),
        cpu=_number("resources.cpu", resources.get("cpu", d["cpu"]), 0),
        gpu=_number("resources.gpu", resources.get("gpu", d["gpu"]), 0, zero_ok=True),
        max_concurrent=None if concurrent is None else _int("max_concurrent", concurrent, 1),
        backend=_one_of("backend", data.get("backend", d["backend"]), BACKENDS),
        max_failures=_int("max_failures", data.get("max_failures", d["max_failures"]), 0),
        max_trials=_int("max_trials", data.get("max_trials", d["max_trials"]), 1),
        health=_health(data.get("health")),
        raw=data,
    )


def _search(value) -> tuple[str, int | None]:
    if isinstance(value, str):
        return _one_of("search", value, SEARCHES), SPEC_DEFAULTS["search_seed"]
    value = _mapping(value, "search")
    _known(value, ("type", "seed"), "search.")
    seed = value.get("seed", SPEC_DEFAULTS["search_seed"])
    if seed is not None:
        _seed("search.seed", seed, " (the sampler seed) or null")
    return _one_of("search.type", value.get("type"), SEARCHES), seed


def _scheduler(value) -> Scheduler:
    if isinstance(value, str) or value is None:
        return Scheduler(type=_one_of("scheduler", value, SCHEDULERS))
    value = _mapping(value, "scheduler")
    _known(value, [f.name for f in fields(Scheduler)], "scheduler.")
    s = Scheduler(type=_one_of("scheduler.type", value.get("type"), SCHEDULERS))
    s = replace(
        s,
        grace_period=_int("scheduler.grace_period", value.get("grace_period", s.grace_period), 1),
        reduction_factor=_number("scheduler.reduction_factor", value.get("reduction_factor", s.reduction_factor), 1),
        time_attr=_one_of("scheduler.time_attr", value.get("time_attr", s.time_attr), ("training_iteration",)),
    )
    if value.get("max_t") is not None:
        s = replace(s, max_t=_int("scheduler.max_t", value["max_t"], s.grace_period))
    return s


def _space(value, overrides: dict) -> tuple[Param, ...]:
    if not value:
        raise SpecError(
            "space is empty: give at least one config key to vary "
            "(e.g. `algo.anchor.tau: {grid: [1.0, 0.9]}`, or `seed: {grid: [0, 1, 2]}` for seeds only)"
        )
    params = tuple(_param(str(name), entry, overrides) for name, entry in _mapping(value, "space").items())
    keys = [k for p in params for k in p.keys]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise SpecError(f"space: {dup[0]} appears in more than one entry")
    return params


def _param(name: str, entry, overrides: dict) -> Param:
    """One space entry; a comma-joined name varies several keys together (grid/choice of lists)."""
    where = f"space.{name}"
    keys = tuple(k.strip() for k in name.split(","))
    if any(not k for k in keys) or len(set(keys)) != len(keys):
        raise SpecError(f"{where}: joint keys must be distinct, comma-separated config keys")
    for k in keys:
        if k == "backend":
            raise SpecError(f"{where}: use the spec's top-level `backend:` key (one backend per sweep)")
        if k in SET_BY_SWEEP:
            raise SpecError(f"{where}: {k} is set by the sweep itself and cannot be swept")
        if k in overrides:
            raise SpecError(f"{where}: {k} is also fixed in base.overrides; keep it in one place")
    entry = _mapping(entry, where)
    if len(entry) != 1 or next(iter(entry)) not in KINDS:
        raise SpecError(f"{where} must have exactly one of: {', '.join(KINDS)}; got {sorted(entry) or 'nothing'}")
    kind, vals = next(iter(entry.items()))
    if not isinstance(vals, list) or not vals:
        raise SpecError(f"{where}.{kind} must be a non-empty list")
    if kind in ("grid", "choice"):
        if len(keys) > 1:
            bad = [v for v in vals if not isinstance(v, list) or len(v) != len(keys)]
            if bad:
                raise SpecError(
                    f"{where}.{kind}: every value must be a list of {len(keys)} (one per key); got {shown(bad[0])}"
                )
            vals = [tuple(v) for v in vals]
        if len({repr(v) for v in vals}) != len(vals):
            raise SpecError(f"{where}.{kind} lists a value twice: {shown(vals)}")
        return Param(keys, kind, tuple(vals))
    if len(keys) > 1:
        raise SpecError(f"{where}: keys varied together take grid or choice, not {kind}")
    if len(vals) != 2 or not all(_is_finite(v) for v in vals) or not vals[0] < vals[1]:
        raise SpecError(f"{where}.{kind} must be [low, high] finite numbers with low < high; got {shown(vals)}")
    if kind == "int" and not all(isinstance(v, int) for v in vals):
        raise SpecError(f"{where}.int bounds must be integers; got {shown(vals)}")
    if kind == "loguniform" and vals[0] <= 0:
        raise SpecError(f"{where}.loguniform needs low > 0; got {shown(vals)}")
    return Param(keys, kind, tuple(vals))


def _health(value) -> dict[str, Any]:
    """`health: {rule: {field: value}}` -> {"health.<rule>.<field>": value}; each rule's section is validated by
    its run-config dataclass (ema_pg_core.config.HealthConfig), so the errors name the same fields."""
    from ema_pg_core.config import HealthConfig

    sections = {f.name: f.default_factory for f in fields(HealthConfig)}
    given = _mapping(value or {}, "health")
    _known(given, tuple(sections), "health.")
    out: dict[str, Any] = {}
    for rule, section in given.items():
        section = _mapping(section if section is not None else {}, f"health.{rule}")
        _known(section, tuple(f.name for f in fields(sections[rule])), f"health.{rule}.")
        bad = [k for k, v in section.items() if v is not None and not _is_num(v)]
        if bad:
            raise SpecError(f"health.{rule}.{bad[0]} must be a number or null; got {shown(section[bad[0]])}")
        try:
            sections[rule](**section)
        except ValueError as e:
            raise SpecError(str(e)) from None
        out.update({f"health.{rule}.{k}": v for k, v in section.items()})
    return out


def _seeds(value, adaptive: Adaptive | None = None) -> tuple[int, ...]:
    if adaptive is not None:
        return adaptive.seeds
    if not isinstance(value, list) or not value:
        raise SpecError(f"seeds must be a non-empty list of integers or {{adaptive: {{...}}}}; got {shown(value)}")
    for i, seed in enumerate(value):
        _seed(f"seeds[{i}]", seed)
    if len(set(value)) != len(value):
        raise SpecError(f"seeds lists a seed twice: {value}")
    return tuple(value)


def _seed(where: str, value, alternative: str = "") -> int:
    """A seed in the range every consumer takes (ema_pg_core.config.SEED_MAX, the one home of that bound)."""
    from ema_pg_core.config import SEED_MAX

    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= SEED_MAX:
        raise SpecError(f"{where} must be an integer in [0, {SEED_MAX}]{alternative}; got {shown(value)}")
    return value


def _adaptive(value) -> Adaptive | None:
    """`seeds: {adaptive: {...}}` -> Adaptive (None for a list of seeds); checked against the space later."""
    if not isinstance(value, dict):
        return None
    _known(value, ("adaptive",), "seeds.")
    a = _mapping(value["adaptive"], "seeds.adaptive")
    d = SPEC_DEFAULTS["seeds.adaptive"]
    _known(a, ("compare", *d), "seeds.adaptive.")
    if "compare" not in a:
        raise SpecError(
            "seeds.adaptive.compare is required: {key: <a grid key of space>, baseline: <one of its values>}"
        )
    compare = _mapping(a["compare"], "seeds.adaptive.compare")
    _known(compare, ("key", "baseline"), "seeds.adaptive.compare.")
    if not isinstance(compare.get("key"), str) or "baseline" not in compare:
        raise SpecError("seeds.adaptive.compare needs key (a grid key of space) and baseline (one of its values)")
    start = _int("seeds.adaptive.start", a.get("start", d["start"]), 2)  # pairing needs two seeds
    metric = a.get("metric", d["metric"])
    confidence = _number("seeds.adaptive.confidence", a.get("confidence", d["confidence"]), 0)
    if confidence >= 1:
        raise SpecError(f"seeds.adaptive.confidence must be in (0, 1); got {shown(confidence)}")
    top = _int("seeds.adaptive.max", a.get("max", d["max"]), start)
    first = _seed("seeds.adaptive.first", a.get("first", d["first"]))
    _seed("seeds.adaptive.first + max - 1 (its last seed)", first + top - 1)
    return Adaptive(
        key=compare["key"],
        baseline=compare["baseline"],
        start=start,
        step=_int("seeds.adaptive.step", a.get("step", d["step"]), 1),
        max=top,
        first=first,
        metric=None if metric is None else _metric_syntax(metric),
        stop_when=_stop_when(a.get("stop_when", [r for r, _ in d["stop_when"]])),
        confidence=confidence,
        reps=_int("seeds.adaptive.reps", a.get("reps", d["reps"]), 100),
    )


def _stop_when(value) -> tuple[tuple[str, float | None], ...]:
    """ci_excludes_zero | {ci_width_below: X} | a list of them (any one met stops) -> ((rule, X or None), ...)."""
    where, allowed = "seeds.adaptive.stop_when", "ci_excludes_zero, {ci_width_below: X} or a list of them"
    rules = []
    for item in value if isinstance(value, list) and value else [value]:
        if item == "ci_excludes_zero":
            rules.append((item, None))
        elif isinstance(item, dict) and list(item) == ["ci_width_below"]:
            rules.append(("ci_width_below", _number(f"{where}.ci_width_below", item["ci_width_below"], 0)))
        else:
            raise SpecError(f"{where}={shown(item)} is not a rule; allowed: {allowed}")
    return tuple(rules)


def _check_adaptive(spec: Spec) -> None:
    """Adaptive seeds need a grid search without early stopping, and compare.key/baseline from the space."""
    a = spec.adaptive
    if a is None:
        return
    if spec.search != "grid" or spec.scheduler.type != "none":
        raise SpecError(
            "seeds.adaptive needs search: grid and scheduler: none (every trial must finish to be paired); "
            f"got search: {spec.search}, scheduler: {spec.scheduler.type}"
        )
    grid = {p.keys[0]: p for p in spec.space if p.kind == "grid" and len(p.keys) == 1}
    if a.key not in grid:
        raise SpecError(
            f"seeds.adaptive.compare.key={shown(a.key)} is not a single-key grid entry of space; "
            f"allowed: {', '.join(grid)}"
        )
    values = grid[a.key].values
    if a.baseline not in values or len(values) < 2:
        raise SpecError(
            f"seeds.adaptive.compare.baseline={shown(a.baseline)} must be one of space.{a.key}'s values "
            f"{shown(list(values))} "
            "(which need at least one other value to compare)"
        )


def _per_trial(spec: Spec) -> str:
    if spec.backend == "verl":
        return "its verl job (a placement group of one 3-CPU + 1-GPU bundle per rank, from the trial's config)"
    return f"{spec.cpu:g} CPU {spec.gpu:g} GPU"


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
    from experiments import build

    groups = _groups()
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
            if p.kind in ("uniform", "loguniform", "int") and not _is_num(node):
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
        spec = replace(spec, scheduler=replace(s, max_t=max_t))
    return spec


def _groups() -> dict[str, list[str]]:
    """Config groups of experiments/conf and their options (every registered task included)."""
    from experiments import build

    return build.group_options()


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
    """Refuse a Top-k KL whose algo.kl.k exceeds its model's vocabulary: the largest k is composed with
    every estimator and model the space can pick (``build.validate`` reads the vocabulary from the
    model's config, no weights loaded)."""
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
    except SpecError:
        raise
    except ValueError as e:  # a bad value or key (build.compose words Hydra's errors as UserError)
        raise SpecError(re.sub(r"\s+", " ", f"{where}: {e}")) from None
    return cfg


def _check_metric(metric: str, tasks: set[str]) -> None:
    from experiments.tasks import TASKS

    key = metric[len("best_") :] if metric.startswith("best_") else metric
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


def _metric_syntax(value) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(f"metric must be a metric key such as eval/math_tiny/acc; got {shown(value)}")
    return value


# ---------------------------------------------------------------------------- trials and the table
def grid_points(spec: Spec) -> list[dict[str, Any]]:
    """Every combination of the grid entries ({config key: value}; the last key varies fastest)."""
    grid = [[p.assign(v) for v in p.values] for p in spec.space if p.kind == "grid"]
    return [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*grid)]


def trials(spec: Spec) -> list[dict[str, Any]]:
    """One row per trial, in launch order: for each seed every grid point. Sampled entries (random,
    optuna) show their distribution."""
    sampled = {p.name: p.describe() for p in spec.space if p.kind != "grid"}
    points = grid_points(spec)
    rows = []
    for sample in range(spec.num_samples):
        for seed in spec.seed_axis:
            for point in points:
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
    sched = (
        "none"
        if s.type == "none"
        else f"asha (grace_period={s.grace_period}, reduction_factor={s.reduction_factor:g}, max_t={s.max_t})"
    )
    first = {k: v for k, v in rows[0].items() if k not in ("seed", "sample") and not str(v).startswith("~")}
    head = [
        f"sweep {spec.name}: {n} trials{' at most' if spec.adaptive else ''}, search={spec.search}"
        + (f" (seed {spec.search_seed})" if spec.search != "grid" else ""),
        f"  metric {spec.metric} ({spec.mode}); scheduler {sched}; health "
        + (" ".join(f"{k[len('health.') :]}={v}" for k, v in spec.health.items()) or "non-finite loss/gradient only"),
        f"  per trial {_per_trial(spec)}; max_concurrent {spec.max_concurrent or 'unlimited'}; "
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
        from sweeps.adaptive import plan_text

        head[3:3] = ["", plan_text(spec)]
    return "\n".join(head)


# ---------------------------------------------------------------------------- helpers
def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(list(v) if isinstance(v, tuple) else v)


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise SpecError(f"{where} must be a mapping; got {type(value).__name__}: {shown(value, 60)}")
    return value


def _known(data: dict, allowed, prefix: str) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        key = str(unknown[0])
        near = difflib.get_close_matches(key[:200], list(allowed), n=1)
        raise SpecError(
            f"unknown key {prefix}{key if len(key) <= 200 else shown(key)}"
            + (f" (did you mean {prefix}{near[0]}?)" if near else "")
            + f"; allowed: {', '.join(allowed)}"
        )


def _one_of(where: str, value, allowed) -> str:
    if value not in allowed:
        raise SpecError(f"{where}={shown(value)} is not allowed; allowed values: {', '.join(allowed)}")
    return value


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    """A number other than NaN and +-inf."""
    return _is_num(v) and math.isfinite(v)


def _int(where: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise SpecError(f"{where} must be an integer >= {low}; got {shown(value)}")
    return value


def _number(where: str, value, low: float, none_ok: bool = False, zero_ok: bool = False):
    if value is None and none_ok:
        return None
    if not _is_finite(value) or value < low or (value == low and not zero_ok):
        number = "a finite number" if _is_num(value) and not math.isfinite(value) else "a number"
        raise SpecError(
            f"{where} must be {number} {'>=' if zero_ok else '>'} {low:g}{' or null' if none_ok else ''}; "
            f"got {shown(value)}"
        )
    return float(value)
