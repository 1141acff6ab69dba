"""tests/sweeps on sys.path: the tests and the Ray workers (via PYTHONPATH, see test_tune.local_ray)
import the stand-ins for experiments.run.run as `sweep_fakes` (the workers through Ray's setup hook,
sweep_fakes.install)."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
