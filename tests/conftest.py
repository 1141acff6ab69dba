"""The test processes compute as `emapg` does: the numerics pins of EMAPG_NUMERICS (experiments/numerics.py) are
set here, before any test module loads torch, and inherited by the processes the tests start (Ray workers too)."""

from experiments import numerics

numerics.pin()
