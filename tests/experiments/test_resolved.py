from experiments.build import presets
from experiments.resolve_presets import OUT, snapshot


def test_resolved_snapshots_are_current():
    stale = [p for p in presets() if not (OUT / f"{p}.yaml").exists() or (OUT / f"{p}.yaml").read_text() != snapshot(p)]
    assert not stale, f"stale snapshots {stale}: run `python -m experiments.resolve_presets` and commit the diff"
