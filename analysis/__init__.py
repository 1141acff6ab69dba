"""emapg.analysis: run records -> tables and figures.

Reads only the run record on disk (docs/run-record.md) or its W&B mirror; never imports torch
or `ema_pg_core` (an import-linter contract in pyproject.toml enforces it).

    analysis.load      find and read run records into tidy pandas frames (disk, W&B)
    analysis.stats     mean, IQM, stratified bootstrap CIs, probability of improvement, pass@k
    analysis.tables    markdown / LaTeX (booktabs) / CSV, paper-format result tables
    analysis.paper     the paper's verified numbers, each with its source tag
    analysis.figures   the figures, each a function returning a Figure; styling in figures/style.py
    analysis.report    `emapg report` and `emapg figures`: write everything + index.md/index.html
    analysis.dashboard `emapg dashboard`: a sweep's W&B workspace and report (built by analysis.wandb_views)

Submodules are imported explicitly (`from analysis import load`) so that `import analysis` stays
cheap.
"""
