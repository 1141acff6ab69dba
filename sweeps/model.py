"""The sweep YAML as typed models (pydantic v2): every key, its type, range, default and allowed values in one
place, and the JSON Schema an editor validates a sweep YAML with (``emapg sweep --schema``). Never ray or Hydra:
what needs the whole spec or the config tree is checked in sweeps.spec.

    model = SweepFile.model_validate(data)   # pydantic.ValidationError: each error's loc is the field path
    spec = Spec.of(model, data)              # the validated spec the sweep runs (sweeps.spec.parse does both)

A union of forms (``search: optuna`` or ``{type: optuna, seed: 7}``) picks its form from the input's shape, so an
error comes from that form alone; the form's name is in parentheses in the error's loc (``('search', '(mapping)',
'seed')``), which experiments.errors.validation_line leaves out of the field path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, create_model, model_validator

from ema_pg_core.config import SEED_MAX, HealthConfig
from ema_pg_core.overrides import hydra_value
from experiments.errors import shown

KINDS = ("grid", "choice", "uniform", "loguniform", "int")
SET_BY_SWEEP = ("run_dir", "out_root", "resume", "sweep.name", "sweep.trial_id", "logger.group", "logger.tags")
MAX_TRIALS = 10_000  # default `max_trials`: a larger sweep is refused before its trials are enumerated
NAME_MAX = 58  # it names a directory and goes into every trial's W&B tag ``sweep:<name>`` (W&B: <= 64 characters)


class Section(BaseModel):
    """A mapping of a sweep YAML: only its own keys; a YAML type is never coerced (strict: "1" is not 1, true is
    not 1, but 1 is a number); numbers are finite; the attribute docstrings are the schema's descriptions."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )


def forms(*branches: tuple[str, Any]) -> Any:
    """A union of (form, type) pairs, form "name", "mapping" or "list": the input's shape picks its branch (a
    mapping, a list, anything else a name), and a shape it has no branch for goes to the first branch."""
    names = [name for name, _ in branches]

    def form(value) -> str:
        shape = "mapping" if isinstance(value, dict) else "list" if isinstance(value, list) else "name"
        return f"({shape if shape in names else names[0]})"

    union = Union[tuple(Annotated[t, Tag(f"({name})")] for name, t in branches)]  # noqa: UP007  (built from a list)
    return Annotated[union, Discriminator(form)]


def _same(value):
    """What two values that compose to the same override share: 1 and 1.0 are one value (each composes to
    tau=1.0, two runs of one configuration); True stays apart from 1, "1" from 1, and a joint row is its items."""
    if isinstance(value, list):
        return tuple(_same(v) for v in value)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


def _distinct(what: str):
    def check(values: list) -> list:
        if len({_same(v) for v in values}) != len(values):
            raise ValueError(f"lists a {what} twice: {shown(values)}")
        return values

    return AfterValidator(check)


Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]  # the range every consumer takes (SEED_MAX, its one home)
Values = Annotated[list[Any], Field(min_length=1, json_schema_extra={"uniqueItems": True}), _distinct("value")]


# ---------------------------------------------------------------------------- base, search, scheduler, budget
def _override_key(key: str) -> str:
    """A base.overrides key the spec's own keys or the sweep do not set."""
    if key == "backend":
        raise ValueError("use the spec's top-level `backend:` key")
    if key == "health" or key.startswith("health."):
        raise ValueError("use the spec's top-level `health:` key")
    if key in SET_BY_SWEEP or key == "seed":
        raise ValueError("set by the sweep itself" + (" (use `seeds: [...]`)" if key == "seed" else ""))
    return key


class Base(Section):
    experiment: str | None = None
    """A preset of experiments/conf/experiment/ (or vary `experiment` in space)."""
    overrides: dict[Annotated[str, AfterValidator(_override_key)], Any] | None = None
    """Fixed config keys (and config groups) of every trial, e.g. {trainer.iterations: 20, logger: none}."""


SearchType = Literal["grid", "random", "optuna"]


class Search(Section):
    type: SearchType
    """grid: every grid value is run; random, optuna: samples of the choice and range entries."""
    seed: Seed | None = 0
    """The sampler's seed."""


SchedulerType = Literal["none", "asha"]


class Scheduler(Section):
    type: SchedulerType = "none"
    """none: every trial runs to the end; asha: weak trials are stopped early."""
    grace_period: int = Field(1, ge=1)
    """ASHA: no trial is stopped before this many iterations."""
    reduction_factor: float = Field(2.0, gt=1)
    """ASHA: the fraction 1/reduction_factor of trials continues at each rung."""
    time_attr: Literal["training_iteration"] = "training_iteration"
    max_t: int | None = Field(None, ge=1)
    """ASHA: the last rung; null = trainer.iterations."""

    @model_validator(mode="after")
    def _max_t_after_grace(self):
        if self.max_t is not None and self.max_t < self.grace_period:
            raise ValueError(
                f"scheduler.max_t must be an integer >= grace_period ({self.grace_period}); got {self.max_t}"
            )
        return self


SearchField = forms(("name", SearchType), ("mapping", Search))
SchedulerField = forms(("name", SchedulerType), ("mapping", Scheduler))


class Budget(Section):
    num_samples: int = Field(1, ge=1)
    """Samples per seed (random, optuna); 1 with search: grid."""
    time_budget_s: float | None = Field(None, gt=0)
    """Wall-clock cap of the sweep in seconds; null = none."""


class Resources(Section):
    cpu: float = Field(1.0, gt=0)
    """CPUs per trial; a local trial sets trainer.threads to them."""
    gpu: float = Field(0.0, ge=0)
    """GPUs per trial."""


# ---------------------------------------------------------------------------- space
class SpaceEntry(Section):
    """One space entry: exactly one field, named after its kind."""

    kind: ClassVar[str]

    @property
    def values(self) -> list:
        """grid/choice: the values; uniform/loguniform/int: [low, high]."""
        return getattr(self, next(iter(type(self).model_fields)))


class Grid(SpaceEntry):
    kind = "grid"
    grid: Values
    """Every value is run (a list per value when keys are varied together)."""


class Choice(SpaceEntry):
    kind = "choice"
    choice: Values
    """Sampled (search: random, optuna)."""


def _increasing(bounds: list) -> list:
    if not bounds[0] < bounds[1]:
        raise ValueError(f"must be [low, high] with low < high; got {bounds}")
    return bounds


def _positive_low(bounds: list) -> list:
    if bounds[0] <= 0:
        raise ValueError(f"needs low > 0; got {bounds}")
    return bounds


Bounds = Annotated[list[float], Field(min_length=2, max_length=2), AfterValidator(_increasing)]


class Uniform(SpaceEntry):
    kind = "uniform"
    uniform: Bounds
    """[low, high], sampled uniformly."""


class LogUniform(SpaceEntry):
    kind = "loguniform"
    loguniform: Annotated[Bounds, AfterValidator(_positive_low)]
    """[low, high] with low > 0, sampled uniformly in log space."""


class IntRange(SpaceEntry):
    kind = "int"
    bounds: Annotated[list[int], Field(min_length=2, max_length=2), AfterValidator(_increasing)] = Field(alias="int")
    """[low, high] integers, both inclusive."""


def _kind(value) -> str | None:
    key = next(iter(value)) if isinstance(value, dict) and len(value) == 1 else None
    return f"({key})" if key in KINDS else None


Entry = Annotated[
    Union[tuple(Annotated[c, Tag(f"({c.kind})")] for c in (Grid, Choice, Uniform, LogUniform, IntRange))],  # noqa: UP007
    Discriminator(
        _kind, custom_error_type="space_entry", custom_error_message=f"must have exactly one of: {', '.join(KINDS)}"
    ),
]


def _space_key(name: str) -> str:
    """A config key, or comma-joined distinct keys varied together, that the sweep may vary."""
    keys = [k.strip() for k in name.split(",")]
    if any(not k for k in keys) or len(set(keys)) != len(keys):
        raise ValueError("joint keys must be distinct, comma-separated config keys")
    for k in keys:
        if k == "backend":
            raise ValueError("use the spec's top-level `backend:` key (one backend per sweep)")
        if k in SET_BY_SWEEP:
            raise ValueError(f"{k} is set by the sweep itself and cannot be swept")
    return name


def _joint(space: dict[str, Any]) -> dict[str, Any]:
    """Keys varied together take grid or choice with one value per key, and no key is in two entries."""
    seen: list[str] = []
    for name, entry in space.items():
        keys = [k.strip() for k in name.split(",")]
        if len(keys) > 1 and entry.kind not in ("grid", "choice"):
            raise ValueError(f"space.{name}: keys varied together take grid or choice, not {entry.kind}")
        bad = [v for v in entry.values if not isinstance(v, list) or len(v) != len(keys)]
        if len(keys) > 1 and bad:
            raise ValueError(
                f"space.{name}.{entry.kind}: every value must be a list of {len(keys)} (one per key); "
                f"got {shown(bad[0])}"
            )
        twice = [k for k in keys if k in seen]
        if twice:
            raise ValueError(f"space: {twice[0]} appears in more than one entry")
        seen += keys
    return space


Space = Annotated[dict[Annotated[str, AfterValidator(_space_key)], Entry], AfterValidator(_joint)]


# ---------------------------------------------------------------------------- seeds
class Compare(Section):
    key: str
    """A single-key grid entry of space."""
    baseline: Any
    """One of its values: every other value is compared with it at the same values of the other keys."""


class CIWidthBelow(Section):
    ci_width_below: float = Field(gt=0)
    """Stop once the CI is narrower than this."""


StopRule = forms(("name", Literal["ci_excludes_zero"]), ("mapping", CIWidthBelow))
StopWhen = forms(
    ("name", Literal["ci_excludes_zero"]),
    ("mapping", CIWidthBelow),
    ("list", Annotated[list[StopRule], Field(min_length=1)]),
)


class Adaptive(Section):
    """`seeds: {adaptive: ...}`: seeds added per comparison until its paired CI meets `stop_when` (sweeps.adaptive).

    Every value of the grid key `compare.key` other than `compare.baseline` is compared with the baseline at the same
    values of the other keys. Round 0 runs seeds first .. first+start-1 everywhere; each later round adds `step` seeds
    to the comparisons whose rule is not met yet (and to their baseline), up to `max` seeds. Each round's look is
    tested at its share of 1 - confidence, so that the whole sequence calls a no-effect comparison clear at most that
    often; an exact paired test needs 6 seeds to decide anything at 95% (the defaults look at 7, 10 and 13)."""

    compare: Compare
    start: int = Field(7, ge=2)
    """Seeds of round 0 (pairing needs two)."""
    step: int = Field(3, ge=1)
    """Seeds added per round to an undecided comparison."""
    max: int = Field(13, ge=2)
    """The most seeds a comparison gets."""
    first: Seed = 0
    """The first seed; seeds are first, first+1, ..."""
    metric: str | None = Field(None, min_length=1)
    """null = the sweep's metric; its final value (best_<key>: its best) is compared."""
    stop_when: StopWhen = "ci_excludes_zero"
    """ci_excludes_zero, {ci_width_below: X}, or a list of them (any one met stops)."""
    confidence: float = Field(0.95, gt=0, lt=1)
    """1 - the chance, over all looks, of calling a comparison with no effect clear."""

    @model_validator(mode="after")
    def _seed_range(self):
        if self.max < self.start:
            raise ValueError(f"seeds.adaptive.max must be an integer >= start ({self.start}); got {self.max}")
        if self.first + self.max - 1 > SEED_MAX:
            raise ValueError(f"seeds.adaptive.first + max - 1 (its last seed) must be <= {SEED_MAX}")
        return self

    @property
    def seeds(self) -> tuple[int, ...]:
        """Every seed a comparison may use (the worst case)."""
        return tuple(range(self.first, self.first + self.max))

    @property
    def rules(self) -> tuple[tuple[str, float | None], ...]:
        """`stop_when` as ((rule, X or None), ...)."""
        items = self.stop_when if isinstance(self.stop_when, list) else [self.stop_when]
        return tuple((r, None) if isinstance(r, str) else ("ci_width_below", r.ci_width_below) for r in items)


class AdaptiveSeeds(Section):
    adaptive: Adaptive


SeedList = Annotated[list[Seed], Field(min_length=1, json_schema_extra={"uniqueItems": True}), _distinct("seed")]
Seeds = forms(("list", SeedList), ("mapping", AdaptiveSeeds))


# ---------------------------------------------------------------------------- health
class HealthSection(Section):
    """A health rule's section: the run config's dataclass (ema_pg_core.config) as a model, its own checks after."""

    rule: ClassVar[type]

    @model_validator(mode="after")
    def _run_config_checks(self):
        self.rule(**self.model_dump())  # __post_init__: a ValueError naming health.<rule>.<field>
        return self


def _rule_model(cls: type) -> type[HealthSection]:
    hints = typing.get_type_hints(cls)
    model = create_model(
        cls.__name__,
        __base__=HealthSection,
        __doc__=cls.__doc__,
        **{f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)},
    )
    model.rule = cls
    return model


Health = create_model(
    "Health",
    __base__=Section,
    __doc__="RL-health stops for every trial (the run config's health section): a rule that fires ends that trial.",
    **{f.name: (_rule_model(f.default_factory) | None, None) for f in dataclasses.fields(HealthConfig)},
)


# ---------------------------------------------------------------------------- the file
class SweepFile(Section):
    """A sweep YAML (sweeps/*.yaml, `emapg sweep X.yaml`): only `name`, `base` and `metric` are required."""

    model_config = ConfigDict(title="emapg sweep spec")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=NAME_MAX)
    """1 to 58 letters, digits, '_', '.', '-' (it names a directory and the W&B tag sweep:<name>, at most 64
    characters)."""
    base: Base
    space: Space | None = None
    """Config key (or comma-joined keys varied together) -> exactly one of grid, choice, uniform, loguniform, int."""
    seeds: Seeds = [0]
    """Every point runs once per seed (or put `seed` in space), or {adaptive: ...}: more seeds only where unclear."""
    search: SearchField = "grid"
    """grid | random | optuna, or {type: ..., seed: the sampler's seed}."""
    scheduler: SchedulerField = "none"
    """none | asha, or {type: asha, ...}."""
    metric: str = Field(min_length=1)
    """A key the runs log (docs/run-record.md), e.g. eval/math_tiny/acc, or best_<key>."""
    mode: Literal["max", "min"] = "max"
    budget: Budget | None = None
    resources: Resources | None = None
    """Per trial (backend: local; a verl trial reserves its whole verl job)."""
    max_concurrent: int | None = Field(None, ge=1)
    """Trials at once; null = as many as the resources allow."""
    backend: Literal["local", "verl"] = "local"
    max_failures: int = Field(1, ge=0)
    """Retries of a failing trial, each from its last checkpoint."""
    max_trials: int = Field(MAX_TRIALS, ge=1)
    """Refuse a sweep of more trials (grid points x seeds x num_samples), counted before any is enumerated."""
    health: Health | None = None

    @model_validator(mode="after")
    def _space_apart_from_overrides(self):
        if not self.space:
            raise ValueError(
                "space is empty: give at least one config key to vary "
                "(e.g. `algo.anchor.tau: {grid: [1.0, 0.9]}`, or `seed: {grid: [0, 1, 2]}` for seeds only)"
            )
        for name in self.space:
            fixed = [k.strip() for k in name.split(",") if k.strip() in (self.base.overrides or {})]
            if fixed:
                raise ValueError(f"space.{name}: {fixed[0]} is also fixed in base.overrides; keep it in one place")
        return self


SPEC_KEYS = tuple(SweepFile.model_fields)  # the top-level keys of a sweep YAML, in the models' order
# the default of every optional key of a sweep YAML (and of `seeds.adaptive`): the models' field defaults
SPEC_DEFAULTS = {name: f.default for name, f in SweepFile.model_fields.items() if not f.is_required()}
SPEC_DEFAULTS["seeds.adaptive"] = {name: f.default for name, f in Adaptive.model_fields.items() if not f.is_required()}


@dataclass(frozen=True)
class Param:
    """One space entry: `keys` (several when varied together) and their values or range."""

    keys: tuple[str, ...]
    kind: str
    values: tuple  # grid/choice: the values (tuples for joint keys); uniform/loguniform/int: (low, high)

    @classmethod
    def of(cls, name: str, entry: SpaceEntry) -> Param:
        keys = tuple(k.strip() for k in name.split(","))
        return cls(keys, entry.kind, tuple(map(tuple, entry.values)) if len(keys) > 1 else tuple(entry.values))

    @property
    def name(self) -> str:
        return ",".join(self.keys)

    def assign(self, value) -> dict[str, Any]:
        """{config key: value} for one value of this entry."""
        return dict(zip(self.keys, value)) if len(self.keys) > 1 else {self.keys[0]: value}

    def describe(self) -> str:
        if self.kind == "grid":
            return f"grid{list(self.values)}"
        if self.kind == "choice":
            return f"~choice{list(self.values)}"
        return f"~{self.kind}({self.values[0]}, {self.values[1]})"


@dataclass(frozen=True)
class Spec:
    """A validated sweep spec (``sweeps.spec.parse``), flattened from its SweepFile (``Spec.of``), which holds the
    defaults. Fields named unlike their YAML key: experiment, overrides = base.*; search_seed = search.seed;
    num_samples, time_budget_s = budget.*; cpu, gpu = resources.*."""

    name: str
    metric: str
    experiment: str | None
    overrides: dict
    space: tuple[Param, ...]
    seeds: tuple[int, ...]
    search: str
    search_seed: int | None
    scheduler: Scheduler
    mode: str
    num_samples: int
    time_budget_s: float | None
    cpu: float
    gpu: float
    max_concurrent: int | None
    backend: str
    max_failures: int
    max_trials: int
    adaptive: Adaptive | None  # `seeds: {adaptive: ...}`; then `seeds` holds every seed it may use
    health: dict
    """`health:` as {dotted run-config key: value} (e.g. health.kl_spike.factor), set for every trial."""
    raw: dict = field(default_factory=dict, compare=False)
    """The YAML as loaded (written to <sweep_dir>/sweep.yaml; compared on --resume)."""

    @classmethod
    def of(cls, m: SweepFile, raw: dict) -> Spec:
        """The Spec of a validated SweepFile; `raw`: the YAML as loaded (health's keys are taken as given)."""
        search = Search(type=m.search) if isinstance(m.search, str) else m.search
        budget, resources = m.budget or Budget(), m.resources or Resources()
        adaptive = m.seeds.adaptive if isinstance(m.seeds, AdaptiveSeeds) else None
        health = {
            f"health.{r}.{k}": v for r, section in (raw.get("health") or {}).items() for k, v in (section or {}).items()
        }
        return cls(
            name=m.name,
            metric=m.metric,
            experiment=m.base.experiment,
            overrides=dict(m.base.overrides or {}),
            space=tuple(Param.of(name, entry) for name, entry in m.space.items()),
            seeds=adaptive.seeds if adaptive else tuple(m.seeds),
            search=search.type,
            search_seed=search.seed,
            scheduler=Scheduler(type=m.scheduler) if isinstance(m.scheduler, str) else m.scheduler,
            mode=m.mode,
            num_samples=budget.num_samples,
            time_budget_s=budget.time_budget_s,
            cpu=resources.cpu,
            gpu=resources.gpu,
            max_concurrent=m.max_concurrent,
            backend=m.backend,
            max_failures=m.max_failures,
            max_trials=m.max_trials,
            adaptive=adaptive,
            health=health,
            raw=raw,
        )

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


def grid_points(spec: Spec) -> list[dict[str, Any]]:
    """Every combination of the grid entries ({config key: value}; the last key varies fastest)."""
    grid = [[p.assign(v) for v in p.values] for p in spec.space if p.kind == "grid"]
    return [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*grid)]
