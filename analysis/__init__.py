"""emapg.analysis: run records -> tables, figures and dashboards (load, stats, tables, paper, figures, report,
dashboard).

Reads only the run record on disk (docs/run-record.md) or its W&B mirror; never imports torch or `ema_pg_core`
(an import-linter contract in pyproject.toml). Submodules are imported explicitly (`from analysis import load`)
so that `import analysis` stays cheap.
"""
