"""The plugin's own settings inside a verl launch: the top-level ``emapg:`` section. Pure Python, no verl.

Read by our trainer, worker and loss only (verl's config dataclasses reject unknown keys). It reaches
``python -m experiments.backends.verl.main`` as ``emapg.*`` overrides (``split_argv``), which
``experiments.backends.verl.launch.to_verl`` writes from a run config.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from ema_pg_core.config import AnchorConfig, KLConfig, LossConfig
from ema_pg_core.kl import get_estimator

TRAINER_MODE = "emapg_sync"  # the name experiments.backends.verl.trainer registers its V1 trainer under
VERL_AGG = {
    "token-mean": "token-mean",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "sum": "token-sum",
}
"""Our loss aggregation names -> verl's ``agg_loss`` modes (same formulas; verl's are global-batch normalised)."""
Device = Literal["cuda", "cpu"]
DEVICES = get_args(Device)
OLD, REF = "emapg_old_", "emapg_ref_"  # prefixes of the Top-k tensors of the pi_old pass and the anchor pass


def _import_name(name: Any) -> Any:
    module, sep, attr = name.partition(":") if isinstance(name, str) else ("", "", "")
    if name is not None and not (sep and attr and all(part.isidentifier() for part in (*module.split("."), attr))):
        raise ValueError(f"emapg.runner_setup must be 'module:function' or null; got {name!r}")
    return name


def _strings(env: Any) -> Any:
    """runner_env's values as strings: Hydra's override parser reads ``WANDB_RUN_ID=123`` as an int."""
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, Mapping) else env


class EmaPGSection(BaseModel):
    """What our verl plugin reads: the core's own dataclasses (their defaults and checks live there) and the
    section's own values; a ``ValidationError``'s ``loc`` is the field path, as for the sweep spec."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    kl: KLConfig = Field(default_factory=KLConfig)
    anchor: AnchorConfig = Field(default_factory=AnchorConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    metrics_path: StrictStr | None = None
    """Where verl's "file" logger writes one JSON line per iteration; null = verl's default."""
    mask_truncated: StrictBool = False
    """Drop responses that reached data.max_response_length from the actor update (``backend.verl.mask_truncated``)."""
    device: Device = "cuda"
    probe_every: StrictInt = Field(0, ge=0)
    """The KL probe every this many iterations (0 = none): ``trainer.probe_every`` resolved."""
    probe_size: StrictInt = Field(16, ge=1)
    runner_setup: Annotated[StrictStr | None, BeforeValidator(_import_name)] = None
    """``module:function`` verl's TaskRunner calls with ``runner_env`` before verl's trackers start
    (``run_runner_setup``; emapg's is ``launch.apply_wandb_env``). None: nothing is called."""
    runner_env: Annotated[dict[StrictStr, StrictStr], BeforeValidator(_strings)] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _shippable(self) -> EmaPGSection:
        if self.kl.coef > 0 and get_estimator(self.kl.type).needs == "full":
            raise ValueError(
                f"algo.kl.type={self.kl.type!r} needs full (B, T, V) anchor logits, which the verl backend "
                "does not ship between workers; use topk_reverse/topk_forward (k up to the vocabulary size "
                "is exact) or a sampled estimator"
            )
        return self

    @classmethod
    def from_config(cls, node: Any) -> EmaPGSection:
        """From the ``emapg`` node of a composed verl config (resolved here) or a plain mapping."""
        if not isinstance(node, dict):
            from omegaconf import OmegaConf  # the verl side only: this module imports no omegaconf

            node = OmegaConf.to_container(node, resolve=True)
        return cls.model_validate(node)


SECTION_SCALARS = tuple(
    name for name in EmaPGSection.model_fields if name not in ("kl", "anchor", "loss", "runner_env")
)


def run_runner_setup(section: Any) -> None:
    """Call the section's ``runner_setup`` hook with its ``runner_env`` (in verl's TaskRunner process)."""
    name = section.get("runner_setup")
    if name:
        module, _, attr = str(name).partition(":")
        getattr(importlib.import_module(module), attr)(_strings(section.get("runner_env") or {}))


def uses_topk(kl: KLConfig) -> bool:
    """The estimator declares Top-k inputs (capability flag, never the name) and the KL is on."""
    return kl.coef > 0 and get_estimator(kl.type).needs == "topk"


def head_keys(kl: KLConfig) -> dict[str, str]:
    """Where the Top-k head lives: ids (pi_old's for reverse, the anchor's for forward) and the anchor's
    log-probs at them (``engine.set_pass(logp=True)``)."""
    reverse = get_estimator(kl.type).direction == "reverse"
    return {"ids": f"{OLD if reverse else REF}topk_ids", "ref_logp_k": f"{REF}logp_k"}


def topk_passes(kl: KLConfig) -> dict[str, dict[str, Any]]:
    """Per pass ("old", "ref", "train"), the ``engine.set_pass`` keyword arguments. Only what the loss reads
    travels to the update: the head ids and the anchor's log-probs there (pi_old's pass sends ids only)."""
    off = {"mode": "off"}
    if not uses_topk(kl):
        return {"old": off, "ref": off, "train": off}
    train = {"mode": "train"}
    if get_estimator(kl.type).direction == "reverse":  # q = top-k of pi_old; anchor gathers there
        return {
            "old": {"mode": "ids", "k": kl.k, "prefix": OLD},
            "ref": {"mode": "gather", "ids_key": f"{OLD}topk_ids", "prefix": REF, "logp": True},
            "train": train,
        }
    ref = {"mode": "self", "k": kl.k, "prefix": REF, "logp": True}  # q = anchor's top-k
    return {"old": off, "ref": ref, "train": train}


def split_argv(argv: list[str]) -> tuple[list[str], EmaPGSection]:
    """(verl overrides, validated emapg section) from ``main``'s argv (``emapg.a.b=v`` -> section). Values are
    read by Hydra's override parser, the reader ``hydra_value`` writes for (YAML would read 1e-05 as a string)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    verl_args, section = [], {}
    for arg in argv:
        if arg.startswith(("emapg.", "+emapg.")):
            key, _, value = arg.lstrip("+").partition("=")
            parts = key.split(".")[1:]
            parsed = OverridesParser.create().parse_override(f"key={value}").value() if value != "" else None
            if len(parts) == 1 and parts[0] in SECTION_SCALARS:
                section[parts[0]] = parsed
            elif len(parts) == 2:
                section.setdefault(parts[0], {})[parts[1]] = parsed
            else:
                raise ValueError(
                    f"{arg!r}: emapg overrides are emapg.<kl|anchor|loss|runner_env>.<field>=<value> or "
                    f"emapg.<{'|'.join(SECTION_SCALARS)}>=<value>"
                )
        else:
            verl_args.append(arg)
    return verl_args, EmaPGSection.model_validate(section)


def rotate(path: str | Path) -> Path:
    """Move a non-empty `path` aside to `<stem>.<n><suffix>` (the next free n >= 1) and return `path`: verl's
    file logger opens it "wb", which would truncate a resumed run's lines."""
    path = Path(path)
    if path.is_file() and path.stat().st_size > 0:
        n = 1
        while (aside := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
            n += 1
        path.rename(aside)
    return path
