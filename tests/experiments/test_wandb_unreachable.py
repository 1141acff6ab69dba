"""W&B online that cannot start ends in one line, within a bounded wait, with no traceback: no API key (or one the
server refuses) is exit 2, a server that does not answer is exit 1 (experiments.wandb_logger.reaching), for
`logger.mode=online` and for `emapg report --wandb-project`.

No network is used: W&B is pointed at a closed local port (WANDB_BASE_URL=http://127.0.0.1:9), with no API key to
be found (WANDB_API_KEY unset, HOME and W&B's config directory fresh and empty). Where W&B must get past its login
to try the server, it is handed a made-up key of the right shape (FAKE_KEY), never a real one.
"""

from __future__ import annotations

import time

import pytest

from experiments import wandb_logger
from experiments.cli import main
from experiments.errors import RunFailed, UserError

FAKE_KEY = "0" * 40
BOUND_S = 60  # seconds: the tests' W&B timeouts are a few seconds; W&B's own defaults took 110 s


@pytest.fixture
def unreachable_wandb(tmp_path, monkeypatch):
    """W&B with no key to find, pointed at a closed port, with short timeouts; its singleton reset around."""
    import wandb

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_MODE", "WANDB_INIT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(name, str(tmp_path / "wandb" / sub))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_HTTP_TIMEOUT", "3")
    from wandb.apis.public.api import Api

    monkeypatch.setattr(Api, "_HTTP_TIMEOUT", 3)  # read from WANDB_HTTP_TIMEOUT once, when W&B's module is imported
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("EMAPG_PROGRESS", "0")
    monkeypatch.chdir(tmp_path)
    wandb.teardown()
    yield tmp_path
    wandb.teardown()


def _emapg(argv, capsys) -> tuple[int, str, float]:
    start = time.monotonic()
    code = main(argv)
    return code, capsys.readouterr().err, time.monotonic() - start


def _ends_in_one_line(err: str, prefix: str, *words: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(prefix), err[-3000:]
    for word in words:
        assert word in last, last
    return last


TRAIN = ["train", "experiment=math_tiny_ema_pg", "smoke=true", "logger.mode=online"]


def test_online_without_an_api_key_is_one_line_exit_2(unreachable_wandb, capsys):
    code, err, took = _emapg([*TRAIN, f"run_dir={unreachable_wandb / 'run'}"], capsys)
    assert code == 2, err[-3000:]
    _ends_in_one_line(err, "emapg train: error: logger.mode=online", "API key", "wandb login", "offline")
    assert took < BOUND_S


def test_online_with_the_server_unreachable_is_one_line_exit_1(unreachable_wandb, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    code, err, took = _emapg([*TRAIN, f"run_dir={unreachable_wandb / 'run'}"], capsys)
    assert code == 1, err[-3000:]
    _ends_in_one_line(err, "emapg train: run failed: logger.mode=online", "did not answer", "offline")
    assert took < BOUND_S


def test_report_from_wandb_without_an_api_key_is_one_line_exit_2(unreachable_wandb, capsys):
    code, err, took = _emapg(["report", "--wandb-project", "p", "--out", str(unreachable_wandb / "out")], capsys)
    assert code == 2, err[-3000:]
    _ends_in_one_line(err, "emapg report: error: emapg report --wandb-project", "API key", "wandb login")
    assert took < BOUND_S


def test_report_from_wandb_with_the_server_unreachable_is_one_line_exit_1(unreachable_wandb, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    code, err, took = _emapg(["report", "--wandb-project", "p", "--out", str(unreachable_wandb / "out")], capsys)
    assert code == 1, err[-3000:]
    _ends_in_one_line(err, "emapg report: run failed: emapg report --wandb-project", "did not answer")
    assert took < BOUND_S


def test_a_wandb_service_that_never_stops_does_not_hold_the_line(unreachable_wandb, monkeypatch, capsys):
    """Seen in CI: W&B's service, busy with the server, never exited, and wandb.teardown waited for it unbounded."""
    import threading

    from wandb.sdk.lib.service import service_process

    released = threading.Event()
    monkeypatch.setattr(service_process.ServiceProcess, "join", lambda self: released.wait() and 0)
    monkeypatch.setattr(wandb_logger, "TEARDOWN_S", 1.0, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    try:
        code, err, took = _emapg(["report", "--wandb-project", "p", "--out", str(unreachable_wandb / "out")], capsys)
    finally:
        released.set()
    assert code == 1, err[-3000:]
    _ends_in_one_line(err, "emapg report: run failed: emapg report --wandb-project", "did not answer")
    assert took < BOUND_S


# ---------------------------------------------------------------- the bounds and the answers, without W&B's service


def test_wandb_init_gets_the_bounded_timeouts_unless_the_environment_sets_them(tmp_path, monkeypatch):
    import wandb

    seen = []

    def init(**kwargs):
        seen.append(kwargs["settings"])
        raise wandb.errors.CommError("context deadline exceeded")

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    monkeypatch.delenv("WANDB_LOGIN_TIMEOUT", raising=False)
    with pytest.raises(RunFailed, match="logger.mode=online: the W&B server did not answer"):
        wandb_logger.WandbLogger(tmp_path / "a", project="p", mode="online")
    assert seen[-1].init_timeout == wandb_logger.INIT_TIMEOUT_S
    assert seen[-1].login_timeout == wandb_logger.LOGIN_TIMEOUT_S
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "7")
    with pytest.raises(RunFailed):
        wandb_logger.WandbLogger(tmp_path / "b", project="p", mode="online")
    assert "init_timeout" not in seen[-1].model_fields_set  # W&B's reading of WANDB_INIT_TIMEOUT stands


def test_a_login_prompt_that_timed_out_is_one_line_exit_2(tmp_path, monkeypatch):
    """At a terminal W&B asks for a key; after login_timeout it gives up and returns a disabled run."""
    import wandb

    class GaveUp:
        disabled, resumed, step = True, False, 0
        finished = None

        def finish(self, exit_code=0):
            GaveUp.finished = exit_code

    monkeypatch.setattr(wandb, "init", lambda **kw: GaveUp())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(UserError, match="login prompt timed out"):
        wandb_logger.WandbLogger(tmp_path, project="p", mode="online")
    assert GaveUp.finished == 1


@pytest.mark.parametrize(
    "status, kind",
    [(401, UserError), (403, UserError), (None, RunFailed), (502, RunFailed)],
)
def test_a_refused_key_is_exit_2_and_an_unanswered_check_exit_1(status, kind):
    import wandb

    class Response:
        http_status = status

    cause = Exception("api request failed")
    cause.response = Response() if status else None
    with pytest.raises(kind):
        with wandb_logger.reaching("logger.mode=online"):
            raise wandb.errors.AuthenticationError("Failed to verify credentials") from cause
    with pytest.raises(UserError, match="refused the API key"):  # a key of the wrong shape: no check ran
        with wandb_logger.reaching("logger.mode=online"):
            raise wandb.errors.AuthenticationError("WANDB_API_KEY invalid: too short")
