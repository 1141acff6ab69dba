"""tests/sweeps on sys.path: the tests and the Ray workers (via PYTHONPATH, see test_tune.local_ray)
import the stand-in trainable as `sweep_fakes`."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
