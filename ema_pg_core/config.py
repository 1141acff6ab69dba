"""Every default lives here. YAML under experiments/conf holds only deltas.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the field
and the allowed values. Paper values are noted where a default differs from them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ema_pg_core.advantages import ADVANTAGES
from ema_pg_core.kl import ALIASES, KL_ESTIMATORS, LOSS_AGG, TAILS


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _choice(name: str, value, allowed) -> None:
    _check(value in allowed, f"{name}={value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}")


@dataclass
class KLConfig:
    type: str = "topk_reverse"
    """Estimator name in ema_pg_core.kl.KL_ESTIMATORS (k1 k2 k3 k3++ k4 k5 k1+ k3+ exact_* topk_*)."""
    k: int = 32
    """Top-k head size (Top-k estimators only); 0 = pure sampled tail, |V| = exact. Paper: 32."""
    tail: str = "unbiased"
    """Top-k tail: unbiased (corrected gradient), paper (Alg 1/2 as written), none (Truncated KL)."""
    coef: float = 0.001
    """beta, the KL coefficient. Paper: 0.001 (both recipes)."""
    use_iw: bool = False
    """Importance weight s = sg(pi/pi_old) (tail only for Top-k). Paper: true for search, false for math."""
    iw_clip_low: float | None = None
    """Lower clip of s; None = no clip (paper)."""
    iw_clip_high: float | None = None
    """Upper clip of s; None = no clip (paper)."""
    fused: bool = True
    """Compute Top-k from hidden states + LM head in chunks (never holds (N, V)) when the model allows."""

    def __post_init__(self):
        allowed = sorted(KL_ESTIMATORS) + sorted(ALIASES)
        _choice("algo.kl.type", self.type, allowed)
        _choice("algo.kl.tail", self.tail, TAILS)
        _check(isinstance(self.k, int) and self.k >= 0, f"algo.kl.k must be an integer >= 0; got {self.k!r}")
        _check(self.coef >= 0, f"algo.kl.coef (beta) must be >= 0; got {self.coef!r}")
        lo, hi = self.iw_clip_low, self.iw_clip_high
        _check(lo is None or lo > 0, f"algo.kl.iw_clip_low must be > 0 or null; got {lo!r}")
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
        _check(0.0 <= self.tau <= 1.0, f"algo.anchor.tau must be in [0, 1]; got {self.tau!r}")
        _check(
            isinstance(self.period, int) and self.period >= 1,
            f"algo.anchor.period must be an integer >= 1 (iterations); got {self.period!r}",
        )


@dataclass
class LossConfig:
    clip_low: float = 0.2
    """PPO epsilon_low: ratio clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO epsilon_high ("clip-higher"): ratio clipped above at 1 + clip_high. Paper: 0.28."""
    dual_clip_c: float | None = 3.0
    """Dual clip for A < 0: loss capped at -c*A; None disables (search recipe). Must be > 1."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient. Paper: 0."""
    agg: str = "token-mean"
    """Aggregation of PG, KL and entropy (token-mean: search; seq-mean-token-mean: math)."""
    log_ratio_clamp: float = 20.0
    """log(pi/pi_old) clamped to [-x, x] before exp (math recipe)."""

    def __post_init__(self):
        _check(0 <= self.clip_low < 1, f"algo.loss.clip_low must be in [0, 1); got {self.clip_low!r}")
        _check(self.clip_high >= 0, f"algo.loss.clip_high must be >= 0; got {self.clip_high!r}")
        _check(
            self.dual_clip_c is None or self.dual_clip_c > 1,
            f"algo.loss.dual_clip_c must be > 1 or null; got {self.dual_clip_c!r}",
        )
        _choice("algo.loss.agg", self.agg, list(LOSS_AGG))


ADVANTAGE_MODES = tuple(ADVANTAGES)
"""``algo.adv.mode`` values: the estimators registered in ``ema_pg_core.advantages.ADVANTAGES``."""


@dataclass
class AdvantageConfig:
    mode: str = "grpo"
    """grpo: (R - mean_g) / (std_g + eps); dr_grpo: R - mean_g (mean-only, Dr. GRPO)."""
    eps: float = 1e-6
    """Added to the group std."""

    def __post_init__(self):
        _choice("algo.adv.mode", self.mode, ADVANTAGE_MODES)


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
    """Sampling temperature; every log-prob and KL uses logits / temperature. Paper: 1.0."""
    top_p: float = 1.0
    """Nucleus sampling. Paper: 1.0 math, 0.95 search (the KL ignores the truncation, as the code does)."""
    max_turns: int = 3
    """Tool calls allowed before the final answer turn (tool tasks only). Paper: 4."""
    max_obs_tokens: int = 160
    """Cap on injected environment tokens per turn (tool tasks only)."""

    def __post_init__(self):
        _check(
            self.group_size >= 2,
            f"rollout.group_size must be >= 2 for GRPO (group advantages); got {self.group_size!r}",
        )
        _check(self.prompts_per_iter >= 1, f"rollout.prompts_per_iter must be >= 1; got {self.prompts_per_iter!r}")
        _check(self.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1; got {self.max_new_tokens!r}")
        _check(self.temperature > 0, f"rollout.temperature must be > 0; got {self.temperature!r}")
        _check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1]; got {self.top_p!r}")
        _check(self.max_turns >= 0, f"rollout.max_turns must be >= 0; got {self.max_turns!r}")


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """AdamW learning rate (tiny models; the paper's 1e-6 is for 1.5B/3B models)."""
    beta1: float = 0.9
    beta2: float = 0.999
    """AdamW betas. Paper: (0.9, 0.999) math, (0.9, 0.95) search."""
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    warmup_iters: int = 0
    """Linear warmup (iterations), then constant."""

    def __post_init__(self):
        _check(self.lr > 0, f"optim.lr must be > 0; got {self.lr!r}")
        _check(self.grad_clip > 0, f"optim.grad_clip must be > 0; got {self.grad_clip!r}")
        _check(self.warmup_iters >= 0, f"optim.warmup_iters must be >= 0; got {self.warmup_iters!r}")


PROBE_EVERY = 5
"""``trainer.probe_every: null``: the KL probe every 5 iterations, on either backend (about 1.5% of training
time on math_tiny, docs/benchmarks.md)."""

PROBE_SIZE = 16
"""``trainer.probe_size: null``: 16 prompts in the KL probe (on verl at most ``rollout.prompts_per_iter``)."""

OLD_LOGPROBS = ("auto", "rollout", "recompute")
"""``trainer.old_logprobs`` values."""

LOCAL_DEVICES = ("cpu", "cuda", "cuda:N", "auto")
"""``trainer.device`` values of the local trainer (N = a CUDA device index)."""
DEVICE_PATTERN = r"cpu|cuda|cuda:[0-9]+|auto"


@dataclass
class TrainerConfig:
    iterations: int = 60
    """Training iterations (rollout batches)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch. Paper: 1."""
    mini_batches: int = 2
    """Optimizer steps per epoch (the batch is split into this many mini-batches). Paper: ~2 math, 10 search."""
    eval_every: int = 10
    """Evaluate policy and anchor every this many iterations (and before training)."""
    eval_size: int = 64
    """Held-out problems evaluated."""
    eval_n: int = 4
    """Samples per problem for pass@1 (mean accuracy over n samples); greedy is separate."""
    eval_temperature: float = 1.0
    """Temperature of the n evaluation samples; 0 = greedy (argmax, so pass@1 = greedy accuracy), on both
    backends (verl: val_kwargs.do_sample=false)."""
    save_every: int = 10
    """Checkpoint every this many iterations (and on SIGTERM/SIGINT); 0 = only at the end."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep (oldest removed)."""
    threads: int = 2
    """torch.set_num_threads."""
    dtype: str = "float32"
    """Policy dtype: float32 | bfloat16 | float64."""
    probe_every: int | None = None
    """Re-score the fixed KL probe set every this many iterations (``kl/exact``, ``kl/estimate_on_probe``,
    ``kl/estimate_gap``; docs/run-record.md); 0 = no probe; null = every ``PROBE_EVERY`` iterations."""
    probe_size: int | None = None
    """Prompts in the probe set, one response each, drawn by the policy once and checkpointed: held-out (test
    split) prompts on the local backend, the first training batch's on verl (ema_pg_core.verl.probe, so at
    most ``rollout.prompts_per_iter`` there); null = ``PROBE_SIZE`` (on verl: capped at prompts_per_iter)."""

    old_logprobs: str = "auto"
    """Where pi_old's per-token statistics (sampled log-prob, top-k head, logsumexp, entropy) come from:
    rollout = the sampler's own logits, kept while decoding (saves one forward pass per iteration);
    recompute = a separate no-grad forward pass over the batch; auto = rollout on the local backend,
    recompute on verl (which always recomputes them). Both are pi_old at the rollout temperature, so
    they differ only by float rounding (KV-cache decode vs full forward): docs/algorithm.md."""
    device: str = "cpu"
    """Where the local trainer runs: cpu | cuda | cuda:N | auto (cuda if available, else cpu). Model, batches,
    sampling generators, anchor and optimizer state all live there. Only the syntax is checked here (configs
    are validated on CPU head nodes); ``ema_pg_core.local.device.resolve_device`` checks that CUDA (and the
    index) exists when the run starts. The cuda path is covered by a gpu-marked test that has NOT been run
    on a GPU (none was available). The verl backend accepts cuda | cpu."""

    @property
    def probe_period(self) -> int:
        """The probe cadence: probe_every, or PROBE_EVERY when it is null (0 = no probe)."""
        return PROBE_EVERY if self.probe_every is None else self.probe_every

    def __post_init__(self):
        _check(self.iterations >= 0, f"trainer.iterations must be >= 0; got {self.iterations!r}")
        _check(self.ppo_epochs >= 1, f"trainer.ppo_epochs must be >= 1; got {self.ppo_epochs!r}")
        _check(self.mini_batches >= 1, f"trainer.mini_batches must be >= 1; got {self.mini_batches!r}")
        _check(self.eval_every >= 1, f"trainer.eval_every must be >= 1; got {self.eval_every!r}")
        _check(self.eval_n >= 1, f"trainer.eval_n must be >= 1; got {self.eval_n!r}")
        _check(self.save_every >= 0, f"trainer.save_every must be >= 0; got {self.save_every!r}")
        _check(
            self.probe_every is None or (isinstance(self.probe_every, int) and self.probe_every >= 0),
            f"trainer.probe_every must be an integer >= 0 (0 = no KL probe) or null; got {self.probe_every!r}",
        )
        _check(
            self.probe_size is None or (isinstance(self.probe_size, int) and self.probe_size >= 1),
            f"trainer.probe_size must be an integer >= 1 (prompts in the KL probe) or null; got {self.probe_size!r}",
        )
        _choice("trainer.dtype", self.dtype, ("float32", "bfloat16", "float64"))
        _choice("trainer.old_logprobs", self.old_logprobs, OLD_LOGPROBS)
        _check(
            isinstance(self.device, str) and re.fullmatch(DEVICE_PATTERN, self.device) is not None,
            f"trainer.device={self.device!r} is not allowed; allowed values: {', '.join(LOCAL_DEVICES)}",
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
        _check(
            self.floor is None or self.floor > 0, f"health.entropy_floor.floor must be > 0 or null; got {self.floor!r}"
        )
        _check(
            _is_int(self.patience, 1), f"health.entropy_floor.patience must be an integer >= 1; got {self.patience!r}"
        )


@dataclass
class KLSpikeRule:
    factor: float | None = None
    """Stop when kl/value exceeds this multiple of its running median; null = off. Must be > 1."""
    window: int = 20
    """The running median is over the previous this many iterations."""
    min_history: int = 5
    """No check before this many previous values exist (the median needs a scale)."""

    def __post_init__(self):
        _check(
            self.factor is None or self.factor > 1, f"health.kl_spike.factor must be > 1 or null; got {self.factor!r}"
        )
        _check(_is_int(self.window, 1), f"health.kl_spike.window must be an integer >= 1; got {self.window!r}")
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
        _check(
            self.frac is None or 0 < self.frac <= 1,
            f"health.length_cap.frac must be in (0, 1] or null; got {self.frac!r}",
        )
        _check(_is_int(self.patience, 1), f"health.length_cap.patience must be an integer >= 1; got {self.patience!r}")


@dataclass
class HealthConfig:
    """Rules that end a run as ``stopped_unhealthy`` (docs/run-record.md). A non-finite loss/total, loss/pg,
    kl/value or train/grad_norm always stops the run (rule ``nonfinite``, no setting); the rules below are off
    until their threshold is set. A sweep's ``health:`` section sets these keys for every trial."""

    entropy_floor: EntropyFloorRule = field(default_factory=EntropyFloorRule)
    kl_spike: KLSpikeRule = field(default_factory=KLSpikeRule)
    length_cap: LengthCapRule = field(default_factory=LengthCapRule)


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
