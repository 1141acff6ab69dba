"""experiments.progress: live bars on a terminal, one line per LOG_INTERVAL_S in a log file, off
with EMAPG_PROGRESS=0."""

import io
import sys

from experiments import progress


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_log_file_gets_a_line_every_interval_a_terminal_a_live_bar(monkeypatch):
    monkeypatch.delenv("EMAPG_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with progress.bar(1000, "pretrain") as bar:
        assert not bar.disable and bar.mininterval == progress.LOG_INTERVAL_S
        for _ in range(1000):
            bar.update(1)
    lines = [s for s in sys.stderr.getvalue().replace("\r", "\n").splitlines() if s.strip()]
    assert len(lines) <= 3 and "1000/1000" in lines[-1]  # first draw, (maybe one timed), the final one
    monkeypatch.setattr("sys.stderr", Tty())
    with progress.bar(10, "pretrain", initial=4) as bar:
        assert bar.mininterval == 0.1 and bar.n == 4


def test_bars_are_off_with_emapg_progress_0_or_show_false(monkeypatch):
    monkeypatch.setattr("sys.stderr", Tty())
    monkeypatch.setenv("EMAPG_PROGRESS", "0")
    assert not progress.enabled() and progress.bar(5, "x").disable
    monkeypatch.setenv("EMAPG_PROGRESS", "1")
    assert progress.enabled() and not progress.bar(5, "x").disable and progress.bar(5, "x", show=False).disable


def test_a_stderr_without_isatty_counts_as_a_log_file(monkeypatch):
    """Ray's workers replace sys.stderr with a Tee that has no isatty (seen in the real-Ray tests)."""

    class Tee:  # write and flush only
        def __init__(self):
            self.buf = io.StringIO()
            self.write, self.flush = self.buf.write, self.buf.flush

    monkeypatch.delenv("EMAPG_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", tee := Tee())
    with progress.bar(3, "x") as bar:
        assert bar.mininterval == progress.LOG_INTERVAL_S
        bar.update(3)
    assert "3/3" in tee.buf.getvalue()


def test_emapg_progress_0_silences_the_hugging_face_bars_too(monkeypatch):
    """transformers' "Loading weights" bar (and huggingface_hub's) follow EMAPG_PROGRESS=0."""
    import huggingface_hub.utils
    import transformers.utils.logging as hf_logging

    hf_logging.enable_progress_bar()  # earlier runs in this process may have turned them off (their effect is global)
    huggingface_hub.utils.enable_progress_bars()
    monkeypatch.setenv("EMAPG_PROGRESS", "1")
    progress.quiet_libraries()
    assert hf_logging.is_progress_bar_enabled() and not huggingface_hub.utils.are_progress_bars_disabled()
    monkeypatch.setenv("EMAPG_PROGRESS", "0")
    try:
        progress.quiet_libraries()
        assert not hf_logging.is_progress_bar_enabled() and huggingface_hub.utils.are_progress_bars_disabled()
    finally:
        hf_logging.enable_progress_bar()
        huggingface_hub.utils.enable_progress_bars()
