"""Composition, validation before any work, and the CLI's help and error paths."""

import subprocess
import sys

import pytest

from experiments import build
from experiments.cli import main


def test_every_preset_composes_and_validates():
    assert {
        "math_tiny_grpo",
        "math_tiny_ema_pg",
        "math_tiny_ema_pg_paper",
        "search_tiny_grpo",
        "search_tiny_ema_pg",
        "search_tiny_ema_pg_paper",
    } <= set(build.presets())
    for p in build.presets():
        cfg = build.compose([f"experiment={p}"])
        assert cfg.experiment == p
        build.validate(cfg)


def test_presets_encode_the_paper_choices():
    grpo = build.compose(["experiment=math_tiny_grpo"])
    ema = build.compose(["experiment=math_tiny_ema_pg"])
    paper = build.compose(["experiment=search_tiny_ema_pg_paper"])
    assert (grpo.algo.kl.type, grpo.algo.anchor.tau) == ("k3", 1.0)
    assert (ema.algo.kl.type, ema.algo.kl.tail, ema.algo.anchor.tau) == ("topk_reverse", "unbiased", 0.9)
    assert (paper.algo.kl.tail, paper.task.name) == ("paper", "search_tiny")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["task.name=chess"], "task.name='chess' is not a known task; allowed: "),
        (["rollout.group_size=1"], "rollout.group_size must be an integer >= 2 for GRPO"),
        (["algo.anchor.tau=1.5"], r"algo.anchor.tau must be in \[0, 1\]"),
        (["algo.anchor.period=0"], "algo.anchor.period must be an integer >= 1"),
        (["algo.kl.type=k7"], "algo.kl.type='k7' is not allowed; allowed values: "),
        (["algo.kl.k=-2"], "algo.kl.k must be an integer >= 0"),
        (["model.path=/nonexistent/model"], "model.path='/nonexistent/model' does not exist"),
        (["backend.name=slurm"], "backend.name='slurm' is not allowed; allowed values: local, verl"),
        (["trainer.dtype=int8"], "trainer.dtype='int8' is not allowed"),
        (["trainer.device=tpu9"], "trainer.device='tpu9' is not allowed; allowed values: cpu, cuda, cuda:N, auto"),
    ],
)
def test_bad_config_fails_before_training_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        build.validate(build.compose(["experiment=math_tiny_ema_pg", *overrides]))


def test_unknown_preset_and_unknown_key():
    with pytest.raises(ValueError, match="unknown experiment preset 'nope'; allowed: .*math_tiny_ema_pg"):
        build.compose(["experiment=nope"])
    with pytest.raises(Exception, match="kk"):
        build.compose(["algo.kl.kk=3"])


def test_smoke_flag_shrinks_the_run():
    cfg = build.compose(["experiment=math_tiny_ema_pg", "smoke=true"])
    assert cfg.trainer.iterations == 2 and cfg.rollout.group_size == 2


def test_cli_help_lists_presets(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "math_tiny_ema_pg" in out and "search_tiny_grpo" in out
    assert main([]) == 0


def test_cli_bad_config_is_one_clear_line(capsys):
    assert main(["train", "experiment=math_tiny_ema_pg", "algo.anchor.tau=2"]) == 2
    err = capsys.readouterr().err
    assert "emapg train: error: algo.anchor.tau must be in [0, 1]" in err and "Traceback" not in err


def test_console_script_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "train" in out.stdout


# ---------------------------------------------------------------- a tool task's retriever answers before any work
def test_an_unreachable_retriever_is_refused_within_seconds(monkeypatch):
    """A server that accepts the connection and never answers: refused once the read times out, naming the URL (the
    default timeouts keep it within 10 s: connect, then read)."""
    import socket
    import time

    assert 2 * build.RETRIEVER_TIMEOUT_S <= 10
    monkeypatch.setattr(build, "RETRIEVER_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = build.compose(["task=search_tiny", f"task.retriever_url={url}"])
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=rf"task.retriever_url={url} is not reachable \(ReadTimeout"):
            build.check_retriever(cfg)
        assert time.monotonic() - t0 < 3


def test_any_http_answer_counts_as_a_reachable_retriever():
    """Search-R1-compatible servers may have no /health: a 404 is an answer. A task without tools is not checked."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class NoHealth(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NoHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        build.check_retriever(build.compose(["task=search_tiny", f"task.retriever_url={url}"]))
        build.check_retriever(build.compose(["task=math_tiny", "task.retriever_url=http://127.0.0.1:1"]))
    finally:
        server.shutdown()
        server.server_close()


def test_a_quoted_run_dir_with_a_leading_tilde_is_under_home(monkeypatch, tmp_path):
    """`run_dir="~/runs/x"` (quoted, as Hydra needs a leading ~) is the home directory's, not ./~/runs/x."""
    from experiments.run import resolve_run_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_run_dir(build.compose(['run_dir="~/runs/x"'])) == tmp_path / "runs" / "x"
    assert resolve_run_dir(build.compose(['out_root="~/o"'])).parent == tmp_path / "o"


def test_a_retriever_that_refuses_the_token_is_refused_before_any_work(monkeypatch):
    """The audit's case: the start-up check counted a 401 as "answers", so a run with a wrong token started."""
    from experiments.ops.retrieval.bm25 import BM25Retriever
    from experiments.ops.retrieval.service import TOKEN_ENV, running_server

    with running_server(BM25Retriever(["a document"]), port=0, token="right-token") as url:
        monkeypatch.setenv(TOKEN_ENV, "wrong-token")
        cfg = build.compose(["task=search_tiny", f"task.retriever_url={url}"])
        with pytest.raises(ValueError, match="refused this client's token"):
            build.check_retriever(cfg)
        monkeypatch.setenv(TOKEN_ENV, "right-token")
        build.check_retriever(cfg)
