"""Faults injected into verl runs by tests/verl/test_failures.py (imported by name in Ray workers:
the tests put this directory on PYTHONPATH)."""


def raising_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """A reward function (verl's compute_score signature) that always raises."""
    raise ValueError("injected reward failure")
