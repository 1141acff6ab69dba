"""Every default lives here. YAML under experiments/conf holds only deltas.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the field
and the allowed values. Paper values are noted where a default differs from them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ema_pg_core.advantages import ADVANTAGES
from ema_pg_core.kl import ALIASES, KL_ESTIMATORS, LOSS_AGG, TAILS


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _choice(name: str, value, allowed) -> None:
    _check(value in allowed, f"{name}={value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}")


def _real(value) -> bool:
    """A finite int or float (not a bool): NaN and +-inf are refused by every numeric field."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_number(
    name: str,
    value,
    low: float,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    null: bool = False,
    why: str = "",
) -> None:
    """Refuse unless `value` is a finite number in the interval (or None where `null`): the message names the field,
    the interval and `why` (e.g. " (0 = off)"), e.g. "optim.beta1 must be in [0, 1); got 1.5"."""
    if value is None and null:
        return
    if _real(value) and (value > low if low_open else value >= low):  # a string is refused, not compared
        if high is None or (value < high if high_open else value <= high):
            return
    if high is None:
        interval = f"{'>' if low_open else '>='} {low:g}"
    else:
        interval = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    number = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
    raise ValueError(f"{name} must be {number}{interval}{why}{' or null' if null else ''}; got {value!r}")


def check_integer(name: str, value, low: int, *, null: bool = False, why: str = "") -> None:
    """Refuse unless `value` is an integer >= low (or None where `null`)."""
    _check(
        (value is None and null) or _is_int(value, low),
        f"{name} must be an integer >= {low}{why}{' or null' if null else ''}; got {value!r}",
    )


SEED_MAX = 2**32 - 1
"""Every seed lies in [0, SEED_MAX], the range of its tightest consumer, numpy's ``np.random.seed`` (the local
trainer's numpy state, Optuna's and Ray Tune's samplers, vLLM's seed on verl)."""


def check_seed(name: str, value) -> None:
    """Refuse a seed outside [0, SEED_MAX] (one line naming the field and the range)."""
    _check(_is_int(value, 0) and value <= SEED_MAX, f"{name} must be an integer in [0, {SEED_MAX}]; got {value!r}")


@dataclass
class KLConfig:
    type: str = "topk_reverse"
    """Estimator name or alias in ema_pg_core.kl (KL_ESTIMATORS, ALIASES)."""
    k: int = 32
    """Top-k head size (Top-k estimators only); 0 = pure sampled tail, |V| = exact. Paper: 32."""
    tail: str = "unbiased"
    """Top-k tail: unbiased (corrected gradient), paper (Alg 1/2 as written), none (Truncated KL)."""
    coef: float = 0.001
    """beta, the KL coefficient, >= 0 (0 = no KL term). Paper: 0.001 (both recipes)."""
    use_iw: bool = False
    """Importance weight s = sg(pi/pi_old) (tail only for Top-k). Paper: true for search, false for math."""
    iw_clip_low: float | None = None
    """Lower clip of s, > 0; None = no clip (paper)."""
    iw_clip_high: float | None = None
    """Upper clip of s, > 0 (and >= iw_clip_low); None = no clip (paper)."""
    fused: bool = True
    """Compute Top-k from hidden states + LM head in chunks (never holds (N, V)) when the model allows."""

    def __post_init__(self):
        allowed = sorted(KL_ESTIMATORS) + sorted(ALIASES)
        _choice("algo.kl.type", self.type, allowed)
        _choice("algo.kl.tail", self.tail, TAILS)
        check_integer("algo.kl.k", self.k, 0)
        check_number("algo.kl.coef (beta)", self.coef, 0)
        lo, hi = self.iw_clip_low, self.iw_clip_high
        check_number("algo.kl.iw_clip_low", lo, 0, low_open=True, null=True)
        check_number("algo.kl.iw_clip_high", hi, 0, low_open=True, null=True)
        _check(lo is None or hi is None or lo <= hi, f"algo.kl.iw_clip_low={lo} > iw_clip_high={hi}")


@dataclass
class AnchorConfig:
    tau: float = 0.9
    """EMA weight on the old anchor (eta in the paper): anchor <- tau*anchor + (1-tau)*policy. 1.0 = fixed
    anchor (plain GRPO), 0.0 = copy the policy. Paper: 0.9 search, 0.95 math."""
    period: int = 10
    """Update the anchor after iterations period, 2*period, ... (training iterations). Paper: 10."""
    fp32_shadow: bool = False
    """Keep an fp32 copy of the anchor and mix in fp32 (for bf16 models; the paper mixes in bf16)."""

    def __post_init__(self):
        check_number("algo.anchor.tau", self.tau, 0, 1)
        check_integer("algo.anchor.period", self.period, 1, why=" (iterations)")

    def due(self, iteration: int) -> bool:
        """Whether the anchor is updated after iteration `iteration` (1-based): after period, 2*period, ...;
        never when tau = 1 (a fixed anchor). Both backends' schedule."""
        return self.tau < 1.0 and iteration > 0 and iteration % self.period == 0


@dataclass
class LossConfig:
    clip_low: float = 0.2
    """PPO epsilon_low, in [0, 1): ratio clipped below at 1 - clip_low (0 = at 1)."""
    clip_high: float = 0.28
    """PPO epsilon_high ("clip-higher"), >= 0: ratio clipped above at 1 + clip_high (0 = at 1). Paper: 0.28."""
    dual_clip_c: float | None = 3.0
    """Dual clip for A < 0: loss capped at -c*A; None disables (search recipe). Must be > 1."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient, >= 0 (0 = no bonus). Paper: 0."""
    agg: str = "token-mean"
    """Aggregation of PG, KL and entropy (token-mean: search; seq-mean-token-mean: math)."""
    log_ratio_clamp: float = 20.0
    """log(pi/pi_old) clamped to [-x, x] before exp (math recipe); x > 0."""

    def __post_init__(self):
        check_number("algo.loss.clip_low", self.clip_low, 0, 1, high_open=True)
        check_number("algo.loss.clip_high", self.clip_high, 0)
        check_number("algo.loss.dual_clip_c", self.dual_clip_c, 1, low_open=True, null=True)
        check_number("algo.loss.entropy_coef", self.entropy_coef, 0)
        _choice("algo.loss.agg", self.agg, list(LOSS_AGG))
        check_number("algo.loss.log_ratio_clamp", self.log_ratio_clamp, 0, low_open=True)


@dataclass
class AdvantageConfig:
    mode: str = "grpo"
    """grpo: (R - mean_g) / (std_g + eps); dr_grpo: R - mean_g (mean-only, Dr. GRPO)."""
    eps: float = 1e-6
    """Added to the group std, > 0 (a group of equal rewards has std 0)."""

    def __post_init__(self):
        _choice("algo.adv.mode", self.mode, tuple(ADVANTAGES))
        check_number("algo.adv.eps", self.eps, 0, low_open=True)


@dataclass
class AlgoConfig:
    kl: KLConfig = field(default_factory=KLConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    adv: AdvantageConfig = field(default_factory=AdvantageConfig)


# --------------------------------------------------------------------------------------
# The local (embedded) trainer
# --------------------------------------------------------------------------------------
@dataclass
class RolloutConfig:
    group_size: int = 8
    """n responses per prompt (the GRPO group). Paper: 8 math, 5 search."""
    prompts_per_iter: int = 8
    """Prompts per training iteration (rollout batch = prompts_per_iter * group_size)."""
    max_new_tokens: int = 48
    """Cap on generated tokens per turn."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts, > 0: every log-prob and KL uses logits / temperature, so the
    policy gradient needs sampled tokens (greedy decoding, T = 0, has no log-probs to train on). Paper: 1.0."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]. Paper: 1.0 math, 0.95 search (the KL ignores the truncation, as the code does)."""
    max_turns: int = 3
    """Tool calls allowed before the final answer turn (tool tasks only), >= 0 (0 = answer at once). Paper: 4."""
    max_obs_tokens: int = 160
    """Cap on injected environment tokens per turn (tool tasks only), >= 1."""

    def __post_init__(self):
        check_integer("rollout.group_size", self.group_size, 2, why=" for GRPO (group advantages)")
        check_integer("rollout.prompts_per_iter", self.prompts_per_iter, 1)
        check_integer("rollout.max_new_tokens", self.max_new_tokens, 1)
        check_number(
            "rollout.temperature",
            self.temperature,
            0,
            low_open=True,
            why=" (the policy gradient needs sampled tokens; greedy is trainer.eval_temperature=0)",
        )
        check_number("rollout.top_p", self.top_p, 0, 1, low_open=True)
        check_integer("rollout.max_turns", self.max_turns, 0)
        check_integer("rollout.max_obs_tokens", self.max_obs_tokens, 1)


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """AdamW learning rate, > 0 (tiny models; the paper's 1e-6 is for 1.5B/3B models)."""
    beta1: float = 0.9
    beta2: float = 0.999
    """AdamW betas, each in [0, 1). Paper: (0.9, 0.999) math, (0.9, 0.95) search."""
    weight_decay: float = 0.01
    """AdamW (decoupled) weight decay, >= 0 (0 = none)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip, > 0."""
    warmup_iters: int = 0
    """Linear warmup (iterations), then constant; 0 = none."""

    def __post_init__(self):
        check_number("optim.lr", self.lr, 0, low_open=True)
        check_number("optim.beta1", self.beta1, 0, 1, high_open=True)
        check_number("optim.beta2", self.beta2, 0, 1, high_open=True)
        check_number("optim.weight_decay", self.weight_decay, 0)
        check_number("optim.grad_clip", self.grad_clip, 0, low_open=True)
        check_integer("optim.warmup_iters", self.warmup_iters, 0, why=" (0 = no warmup)")


PROBE_EVERY = 5
"""``trainer.probe_every: null``: the KL probe every 5 iterations, on either backend (about 1.5% of training
time on math_tiny, docs/benchmarks.md)."""

PROBE_SIZE = 16
"""``trainer.probe_size: null``: 16 prompts in the KL probe (on verl at most ``rollout.prompts_per_iter``)."""

LOCAL_DEVICES = ("cpu", "cuda", "cuda:N", "auto")  # trainer.device (N = a CUDA device index)
DEVICE_PATTERN = r"cpu|cuda|cuda:[0-9]+|auto"


@dataclass
class TrainerConfig:
    iterations: int = 60
    """Training iterations (rollout batches), >= 0 (0 = evaluate the initial model only)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch. Paper: 1."""
    mini_batches: int = 2
    """Optimizer steps per epoch, one per equal mini-batch, so it must divide the batch (``check_batch_split``;
    on verl, the rollout.prompts_per_iter prompts). Paper: ~2 math, 10 search."""
    eval_every: int = 10
    """Evaluate policy and anchor every this many iterations (and before training)."""
    eval_size: int = 64
    """Held-out problems evaluated, >= 1 (local backend: at most task.test_size)."""
    eval_n: int = 4
    """Samples per problem for pass@1 (mean accuracy over n samples); greedy is separate."""
    eval_temperature: float = 1.0
    """Temperature of the n evaluation samples, >= 0; 0 = greedy (argmax, so pass@1 = greedy accuracy), on both
    backends (verl: val_kwargs.do_sample=false)."""
    save_every: int = 10
    """Checkpoint every this many iterations (and on SIGTERM/SIGINT); 0 = only at the end."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep (oldest removed), >= 1: the newest is what a resume continues from."""
    threads: int = 1
    """torch.set_num_threads, >= 1. 1: the numbers are the same from run to run (and, with EMAPG_NUMERICS's pins,
    across x86-64 CPUs); with more threads they were not on a 2-core AMD EPYC (docs/usage.md)."""
    dtype: str = "float32"
    """Policy dtype: float32 | bfloat16 | float64."""
    probe_every: int | None = None
    """Re-score the fixed KL probe set every this many iterations (``kl/exact``, ``kl/estimate_on_probe``,
    ``kl/estimate_gap``; docs/run-record.md); 0 = no probe; null = every ``PROBE_EVERY`` iterations."""
    probe_size: int | None = None
    """Prompts in the probe set, one response each, drawn by the initial policy: held-out prompts on the local
    backend (at most task.test_size), the first training batch's on verl (at most ``rollout.prompts_per_iter``);
    null = ``PROBE_SIZE``, capped at that bound. A value above the bound is refused, not cut."""

    old_logprobs: str = "auto"
    """Where pi_old's per-token statistics come from: rollout = the sampler's logits, kept while decoding (one
    forward pass fewer per iteration); recompute = a no-grad forward pass; auto = rollout on the local backend,
    recompute on verl (which always recomputes). They differ only by float rounding: docs/algorithm.md."""
    device: str = "cpu"
    """Where the local trainer runs: cpu | cuda | cuda:N | auto (cuda if available, else cpu); verl accepts cuda |
    cpu. Only the syntax is checked here (configs are validated on CPU head nodes); ``resolve_device`` checks
    that the device exists when the run starts."""

    @property
    def resolved_probe_every(self) -> int:
        """The probe cadence: probe_every, or PROBE_EVERY when it is null (0 = no probe)."""
        return PROBE_EVERY if self.probe_every is None else self.probe_every

    def __post_init__(self):
        check_integer("trainer.iterations", self.iterations, 0)
        check_integer("trainer.ppo_epochs", self.ppo_epochs, 1)
        check_integer("trainer.mini_batches", self.mini_batches, 1)
        check_integer("trainer.eval_every", self.eval_every, 1)
        check_integer("trainer.eval_size", self.eval_size, 1)
        check_integer("trainer.eval_n", self.eval_n, 1)
        check_number("trainer.eval_temperature", self.eval_temperature, 0, why=" (0 = greedy)")
        check_integer("trainer.save_every", self.save_every, 0, why=" (0 = only at the end)")
        check_integer("trainer.keep_checkpoints", self.keep_checkpoints, 1, why=" (a resume needs the newest)")
        check_integer("trainer.threads", self.threads, 1)
        check_integer("trainer.probe_every", self.probe_every, 0, null=True, why=" (0 = no KL probe)")
        check_integer("trainer.probe_size", self.probe_size, 1, null=True, why=" (prompts in the KL probe)")
        _choice("trainer.dtype", self.dtype, ("float32", "bfloat16", "float64"))
        _choice("trainer.old_logprobs", self.old_logprobs, ("auto", "rollout", "recompute"))
        _check(
            isinstance(self.device, str) and re.fullmatch(DEVICE_PATTERN, self.device) is not None,
            f"trainer.device={self.device!r} is not allowed; allowed values: {', '.join(LOCAL_DEVICES)}",
        )


def check_batch_split(rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    """The local backend splits each batch of rollout.prompts_per_iter x rollout.group_size sequences into
    trainer.mini_batches equal mini-batches, one optimizer step each: refuse a count that does not divide it (a
    split into unequal parts, or fewer, would silently change the number of optimizer steps)."""
    P, G, m = rollout.prompts_per_iter, rollout.group_size, trainer.mini_batches
    B = P * G
    divisors = [d for d in range(1, B + 1) if B % d == 0]
    shown = ", ".join(map(str, divisors)) if len(divisors) <= 16 else f"{len(divisors)} divisors"
    _check(
        B % m == 0,
        f"trainer.mini_batches={m} must divide the batch of rollout.prompts_per_iter x rollout.group_size = "
        f"{P} x {G} = {B} sequences (equal mini-batches, one optimizer step each); allowed: {shown}",
    )


def eval_problems(trainer: TrainerConfig, test_size: int) -> int:
    """Problems the local backend evaluates from a held-out split of `test_size`: trainer.eval_size, refused (naming
    the split) when it exceeds the split (never cut silently)."""
    _within_split("eval_size", trainer.eval_size, test_size)
    return trainer.eval_size


def probe_prompts(trainer: TrainerConfig, test_size: int) -> int:
    """Prompts in the local backend's KL probe, from a held-out split of `test_size`: trainer.probe_size (refused,
    naming the split, when it exceeds it), or for null the smaller of PROBE_SIZE and the split."""
    _within_split("probe_size", trainer.probe_size, test_size)
    return min(PROBE_SIZE, test_size) if trainer.probe_size is None else trainer.probe_size


def _within_split(name: str, value: int | None, test_size: int) -> None:
    _check(
        value is None or value <= test_size,
        f"trainer.{name}={value} exceeds the held-out split (task.test_size={test_size} problems); "
        f"allowed: 1..{test_size}" + (", or null" if name == "probe_size" else ""),
    )


# --------------------------------------------------------------------------------------
# RL-health stops (ema_pg_core/health.py): one section per rule kind of HEALTH_RULES
# --------------------------------------------------------------------------------------
@dataclass
class EntropyFloorRule:
    floor: float | None = None
    """Stop when train/entropy (nats per response token) stays below this; null = off."""
    patience: int = 5
    """... for this many consecutive iterations."""

    def __post_init__(self):
        check_number("health.entropy_floor.floor", self.floor, 0, low_open=True, null=True)
        check_integer("health.entropy_floor.patience", self.patience, 1)


@dataclass
class KLSpikeRule:
    factor: float | None = None
    """Stop when kl/value exceeds this multiple of its running median; null = off. Must be > 1."""
    window: int = 20
    """The running median is over the previous this many iterations."""
    min_history: int = 5
    """No check before this many previous values exist (the median needs a scale)."""

    def __post_init__(self):
        check_number("health.kl_spike.factor", self.factor, 1, low_open=True, null=True)
        check_integer("health.kl_spike.window", self.window, 1)
        _check(
            _is_int(self.min_history, 1) and self.min_history <= self.window,
            f"health.kl_spike.min_history must be an integer in [1, health.kl_spike.window={self.window}]; "
            f"got {self.min_history!r}",
        )


@dataclass
class LengthCapRule:
    frac: float | None = None
    """Stop when at least this fraction of an iteration's responses hit the length cap (train/len_capped);
    null = off. In (0, 1]."""
    patience: int = 3
    """... in this many consecutive iterations."""

    def __post_init__(self):
        check_number("health.length_cap.frac", self.frac, 0, 1, low_open=True, null=True)
        check_integer("health.length_cap.patience", self.patience, 1)


@dataclass
class HealthConfig:
    """Rules that end a run as ``stopped_unhealthy`` (docs/run-record.md), off until their threshold is set; the
    ``nonfinite`` rule has no setting and is always on. A sweep's ``health:`` section sets them for every trial."""

    entropy_floor: EntropyFloorRule = field(default_factory=EntropyFloorRule)
    kl_spike: KLSpikeRule = field(default_factory=KLSpikeRule)
    length_cap: LengthCapRule = field(default_factory=LengthCapRule)
