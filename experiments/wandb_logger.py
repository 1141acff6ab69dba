"""Weights & Biases mirror of the run record's metrics; offline by default.

    logger = WandbLogger(run_dir, project="emapg", group=sweep_or_experiment, tags=[...],
                         config=resolved_cfg_dict, name=run_id, mode=cfg.logger.mode)
    logger.log(iteration, record.log(iteration, metrics))   # step=iteration; time_s mirrored too
    logger.finish(exit_code)

- Mode (`resolve_mode`): offline needs no account or network: `wandb sync <run_dir>/wandb/offline-run-*` uploads
  later (a resumed run has one offline-run directory per attempt, all with the same run id). disabled writes
  nothing at all: wandb is not even imported.
- Resuming: the W&B run id lives in <run_dir>/wandb_run.json together with the last logged step,
  so a restarted run continues the same W&B run (`resume="allow"`) and skips every step <= the
  last one logged. The steps between the checkpoint and the crash therefore keep the values of
  the crashed attempt in W&B; the run record (rewound and rewritten) is the source of truth.
- A failing W&B call never kills training: it warns once and the logger turns itself off.
- Starting W&B online ends in one line, within a bounded wait (`settings`: W&B's own init and login timeouts),
  when it cannot start (`reaching`): no API key, or one the server refuses, is the user's to fix (UserError, exit
  2); a server that does not answer is a run that failed (RunFailed, exit 1). `emapg report --wandb-project` goes
  through `reaching` too (experiments.cli).
- No API key is read or written here; `wandb login` / WANDB_API_KEY are W&B's business.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import yaml

from experiments.errors import RunFailed, UserError
from experiments.records import WANDB_STATE, atomic_write, read_wandb_state

MODES = ("online", "offline", "disabled")
_LEGACY = {"dryrun": "offline", "run": "online"}


def resolve_mode(configured: str | None) -> str:
    """WANDB_MODE (if set and non-empty) > the configured mode > "offline"."""
    env = os.environ.get("WANDB_MODE") or None
    mode = env or configured or "offline"
    mode = _LEGACY.get(mode, mode)
    if mode not in MODES:
        source = "the WANDB_MODE environment variable" if env else "logger.mode"
        raise ValueError(f"W&B mode {mode!r} from {source} is not allowed; allowed values: {', '.join(MODES)}")
    return mode


INIT_TIMEOUT_S = 30.0  # wandb.init's wait for the server online (W&B's default: 90 s) unless WANDB_INIT_TIMEOUT sets it
LOGIN_TIMEOUT_S = 60.0  # W&B's login prompt's (no key, a terminal): W&B's default is for ever; WANDB_LOGIN_TIMEOUT


def settings():
    """wandb.Settings bounding W&B's waits to INIT_TIMEOUT_S and LOGIN_TIMEOUT_S, each where the environment does
    not set it (W&B reads WANDB_INIT_TIMEOUT, WANDB_LOGIN_TIMEOUT itself; a setting given here would win)."""
    import wandb

    bounds = {"init_timeout": INIT_TIMEOUT_S, "login_timeout": LOGIN_TIMEOUT_S}
    return wandb.Settings(**{k: v for k, v in bounds.items() if not os.environ.get(f"WANDB_{k.upper()}")})


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _key_refused(err: BaseException) -> bool:
    """Is W&B's AuthenticationError about the key itself (its format, or the server answering 401/403), not about
    reaching the server to check it? W&B raises it for both; only a check that ran has a cause."""
    cause = err.__cause__
    return cause is None or getattr(getattr(cause, "response", None), "http_status", None) in (401, 403)


# How long `reaching` waits for W&B's service process to stop after an error. One still busy with a server that did
# not answer held `emapg report --wandb-project` past pytest's 10 minutes in CI (wandb 0.31: `wandb.teardown` waits
# with no bound). Past this the line is printed anyway; the service watches our pid and ends with us.
TEARDOWN_S = 30.0


def _teardown_within(teardown: Callable[[], None], seconds: float) -> None:
    """teardown() (wandb.teardown), waited for at most `seconds` (in a daemon thread, which does not hold the exit);
    a W&B that failed to start may fail to stop too: the error being raised stands."""

    def quietly() -> None:
        with suppress(Exception):
            teardown()

    stopping = threading.Thread(target=quietly, name="wandb-teardown", daemon=True)
    stopping.start()
    stopping.join(seconds)


OFFLINE = "log offline (logger.mode=offline) and `wandb sync` the run later"  # `reaching`'s advice for a run


@contextmanager
def reaching(what: str, instead: str = OFFLINE) -> Iterator[None]:
    """W&B's errors inside, as one line naming `what` (the setting or flag that wants W&B online) and what to do
    `instead`: no API key, a key the server refuses or a W&B setting it rejects -> UserError (exit 2); the server
    unreachable or too slow (W&B's CommError, its init timeout) -> RunFailed (exit 1). W&B is torn down first
    (waiting TEARDOWN_S at most), so its own closing lines come before that one. No key is read or written here:
    W&B's login does."""
    import wandb

    try:
        yield
    except (wandb.errors.Error, TimeoutError) as err:
        _teardown_within(wandb.teardown, TEARDOWN_S)  # prints W&B's "Find logs at" now, not after our line at exit
        detail = _one_line(err)
        if isinstance(err, wandb.errors.UsageError):  # no key and no terminal to ask at, or a setting W&B refuses
            raise UserError(
                f"{what}: W&B cannot start ({detail}); `wandb login` (or W&B's WANDB_API_KEY) gives it a key; "
                f"or {instead}"
            ) from None
        if isinstance(err, wandb.errors.AuthenticationError) and _key_refused(err):
            raise UserError(
                f"{what}: W&B refused the API key ({detail}); `wandb login --relogin` gives it another; or {instead}"
            ) from None
        raise RunFailed(  # CommError: the server unreachable, or not within init_timeout
            f"{what}: the W&B server did not answer ({detail}); check the network and WANDB_BASE_URL, or {instead}"
        ) from None


def new_run_id() -> str:
    """8 random lowercase letters/digits, the shape of the ids W&B generates."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbLogger:
    """One W&B run per run directory, resumed across restarts. `wandb_run_id` is None when disabled."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        project: str,
        group: str | None = None,
        tags: Iterable[str] = (),
        config: Mapping[str, Any] | None = None,
        name: str | None = None,
        mode: str | None = "offline",
    ):
        self.run_dir, self.project = Path(run_dir), project
        self.mode = resolve_mode(mode)
        self.wandb_run_id: str | None = None
        self.last_step: int | None = None
        self._run = None
        if self.mode == "disabled":
            return
        import wandb

        state = _start_state(self.run_dir, project, self.mode)  # before init: a crash in it resumes the same W&B run
        self.wandb_run_id, self.last_step = state["id"], state["last_step"]
        what = "WANDB_MODE=online" if os.environ.get("WANDB_MODE") else "logger.mode=online"
        with reaching(what if self.mode == "online" else f"W&B mode {self.mode}"):
            self._run = wandb.init(
                project=project,
                group=group,
                tags=list(tags or ()),
                config=config,
                name=name or self.run_dir.name,
                id=self.wandb_run_id,
                dir=str(self.run_dir),
                mode=self.mode,
                resume="allow",
                reinit="create_new",
                settings=settings(),
            )
        if self.mode == "online" and self._run.disabled:  # W&B's login prompt timed out: it gave up on the run
            self.finish(exit_code=1)
            raise UserError(
                f"{what}: W&B found no API key and its login prompt timed out; run `wandb login`, or {OFFLINE}"
            )
        if self._run.resumed and self._run.step > 0:  # online: the server knows the next step
            self.last_step = max(self.last_step if self.last_step is not None else -1, self._run.step - 1)

    def log(self, iteration: int, metrics: Mapping[str, Any]) -> bool:
        """Log `metrics` at step=iteration; returns False if skipped (disabled, or already logged)."""
        iteration = int(iteration)
        if self._run is None or (self.last_step is not None and iteration <= self.last_step):
            return False
        payload = {k: v for k, v in metrics.items() if k != "iteration" and v is not None}
        try:
            self._run.log(payload, step=iteration)
        except Exception as err:  # the mirror must not end a run whose record is intact
            warnings.warn(
                f"W&B logging failed at step {iteration} ({err!r}); continuing without W&B. "
                f"The run record in {self.run_dir} is complete.",
                stacklevel=2,
            )
            self.finish(exit_code=1)
            return False
        self.last_step = iteration
        _save_state(self.run_dir, {"id": self.wandb_run_id, "last_step": iteration, "project": self.project}, self.mode)
        return True

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.finish(1 if exc is not None else 0)
        return False

    def finish(self, exit_code: int = 0) -> None:
        """Close the W&B run (idempotent); a non-zero exit_code marks it failed in W&B."""
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish(exit_code=exit_code)
            except Exception as err:
                warnings.warn(f"W&B finish failed ({err!r})", stacklevel=2)


def _start_state(run_dir: Path, project: str, mode: str) -> dict:
    """The W&B run's id (the one in wandb_run.json, else a new one) and last step logged, saved at once."""
    saved = read_wandb_state(run_dir)
    state = {"id": saved.get("id") or new_run_id(), "last_step": saved.get("last_step"), "project": project}
    run_dir.mkdir(parents=True, exist_ok=True)
    _save_state(run_dir, state, mode)
    return state


def _save_state(run_dir: Path, state: dict, mode: str) -> None:
    atomic_write(run_dir / WANDB_STATE, json.dumps({**state, "mode": mode}) + "\n")


VERL_CONFIG = "wandb_config.yaml"  # the run's config in W&B's config-file format, for verl's tracker (``verl_env``)


def verl_env(
    run_dir: str | Path,
    *,
    project: str,
    group: str | None,
    tags: Iterable[str],
    config: Mapping[str, Any],
    mode: str | None,
) -> dict[str, str]:
    """The W&B settings of a verl run as WANDB_* variables (experiments.backends.verl.launch.WANDB_ENV); {} when
    disabled. verl 0.9.1's tracker passes wandb.init only project, name (the run id), entity and verl's
    config, so the id (kept in <run_dir>/wandb_run.json, as WandbLogger keeps it: a resumed run continues
    the same W&B run), resume, group, tags, mode and directory go through the environment, and the run's
    own config through WANDB_CONFIG_PATHS (wandb puts those keys first; verl's own config adds its
    sections, except `trainer`, which ours holds)."""
    mode = resolve_mode(mode)
    if mode == "disabled":
        return {}
    run_dir = Path(run_dir)
    state = _start_state(run_dir, project, mode)
    atomic_write(run_dir / VERL_CONFIG, yaml.safe_dump({k: {"value": v} for k, v in config.items()}, sort_keys=False))
    env = {
        "WANDB_RUN_ID": state["id"],
        "WANDB_RESUME": "allow",
        "WANDB_RUN_GROUP": group or "",
        "WANDB_TAGS": ",".join(tags),
        "WANDB_MODE": mode,
        "WANDB_DIR": str(run_dir.resolve()),
        "WANDB_CONFIG_PATHS": str((run_dir / VERL_CONFIG).resolve()),
    }
    return {k: v for k, v in env.items() if v}


class NullLogger(WandbLogger):
    """logger=none: a WandbLogger that never starts a W&B run (WANDB_MODE is not read): it logs nothing."""

    def __init__(self):
        self.mode, self.wandb_run_id, self.last_step, self._run = "none", None, None, None
