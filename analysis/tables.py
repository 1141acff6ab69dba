"""Tables: markdown / LaTeX (booktabs) / CSV writers and the paper-format result tables.

    t = paper_table(runs, "search", reps=2000, seed=0)   # -> Table (the task's REPORTING: benchmarks, metric)
    write_table(t, "out/")                                # out/search_main.{md,tex,csv}

A `Table` holds display strings (`cells`, what .md/.tex show) and the numbers behind them (`numbers`, what .csv
holds). Our cells are mean ± half-width of the 95% stratified-bootstrap CI over seeds; a cell with no number is
"—", never filled in. Gains, P(improvement) and the decision come from one comparison (`compare`), paired over
seeds where it can be. What a task's tables show is its module's REPORTING (experiments.tasks.Reporting).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import paper, stats
from experiments.tasks import reporting

NA = "—"
NUMBER_COLUMNS = ["row", "column", "value", "ci_low", "ci_high", "n", "unit", "source"]  # Table.numbers
GROUP = "variant"  # the result tables' rows: one per method (analysis.load's variant label)
PASS_KS = (1, 2, 4, 8, 16, 32)  # passk_table's k, those each problem's n samples allow
METRIC_NAMES = {"acc": "greedy accuracy", "pass@1": "pass@1 (mean accuracy over n samples)"}


@dataclass
class Table:
    name: str  # file stem
    caption: str
    cells: pd.DataFrame  # display strings; the index holds the row labels
    numbers: pd.DataFrame  # tidy: NUMBER_COLUMNS
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- writers


def to_markdown(df: pd.DataFrame, caption: str | None = None) -> str:
    """A GitHub markdown table of `df` (index as the first column when it is named or labelled)."""
    df = _with_index(df)
    esc = lambda v: _cell(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(c) for c in df.columns) + " |", "|" + "|".join("---" for _ in df.columns) + "|"]
    lines += ["| " + " | ".join(esc(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return (f"{caption}\n\n" if caption else "") + "\n".join(lines) + "\n"


def to_latex(df: pd.DataFrame, caption: str | None = None, label: str | None = None) -> str:
    """A booktabs `table` environment (needs \\usepackage{booktabs}); text is LaTeX-escaped."""
    df = _with_index(df)
    body = [" & ".join(latex_escape(c) for c in df.columns) + r" \\", r"\midrule"]
    body += [" & ".join(latex_escape(_cell(v)) for v in row) + r" \\" for row in df.itertuples(index=False)]
    out = [r"\begin{table}[t]", r"\centering", r"\small"]
    if caption:
        out.append(r"\caption{" + latex_escape(caption) + "}")
    if label:
        out.append(r"\label{" + label + "}")
    tabular = r"\begin{tabular}{l" + "r" * (len(df.columns) - 1) + "}"
    out += [tabular, r"\toprule", *body, r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(out) + "\n"


def write_table(table: Table, out_dir: str | Path) -> list[Path]:
    """<name>.md and <name>.tex (display cells, caption, notes) and <name>.csv (numbers)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = to_markdown(table.cells, table.caption)
    if table.notes:
        md += "\n" + "\n".join(f"- {n}" for n in table.notes) + "\n"
    paths = [out_dir / f"{table.name}{ext}" for ext in (".md", ".tex", ".csv")]
    paths[0].write_text(md, encoding="utf-8")
    paths[1].write_text(to_latex(table.cells, table.caption, f"tab:{table.name}"), encoding="utf-8")
    table.numbers.to_csv(paths[2], index=False)  # NaN: an empty field
    return paths


# characters LaTeX reserves, and the Unicode symbols the tables use (set in math mode: their command)
_MATH = {"±": r"\pm", "≤": r"\le", "≥": r"\ge", "✓": r"\checkmark", "✗": r"\times", "×": r"\times", "‖": r"\|"}
_GREEK = {"τ": r"\tau", "η": r"\eta", "α": r"\alpha", "β": r"\beta", "θ": r"\theta"}
_LATEX = {
    "\\": r"\textbackslash{}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "—": "---",
    **{ch: "\\" + ch for ch in "&%$#_{}"},
    **{ch: f"${cmd}$" for ch, cmd in {**_MATH, **_GREEK, "|": "|", "<": "<", ">": ">"}.items()},
}


def latex_escape(text: Any) -> str:
    """Escape LaTeX specials and map the few Unicode symbols the tables use to math mode."""
    return "".join(_LATEX.get(ch, ch) for ch in str(text))


# ---------------------------------------------------------------- cell formatting


def fmt_ci(mean: float, lo: float, hi: float) -> str:
    """ "53.9 ± 1.2" (percent, ± half-width of the CI), "53.9" without a CI, "—" without a number."""
    if mean is None or not np.isfinite(mean):
        return NA
    if lo is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return f"{mean * 100:.1f}"
    return f"{mean * 100:.1f} ± {(hi - lo) / 2 * 100:.1f}"


def fmt_gain(g: float, lo: float = math.nan, hi: float = math.nan) -> str:
    """ "+12.0% [+3.1, +20.4]" for a relative gain (fractions in, percent out); an unbounded end of the CI
    (the exact test cannot reject any shift that far at this n) shows as -inf / +inf."""
    if not np.isfinite(g):
        return NA
    end = lambda v: f"{v * 100:+.1f}" if np.isfinite(v) else "-inf" if v < 0 else "+inf"  # noqa: E731
    return f"{g * 100:+.1f}%" + (f" [{end(lo)}, {end(hi)}]" if not (np.isnan(lo) or np.isnan(hi)) else "")


def normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_benchmarks(
    columns: Sequence[str], prefix: str, metric: str, names: dict[str, str] | None = None
) -> dict[str, str]:
    """Display benchmark name -> column, for columns `<prefix><benchmark>/<metric>` (e.g. prefix "final/eval/",
    metric "acc"). `names`: normalised logged name -> display name (a task's REPORTING.names); names not in it
    keep their own spelling."""
    found = {}
    pat = re.compile(re.escape(prefix) + r"(?P<b>[^/]+)/" + re.escape(metric) + "$")
    for col in columns:
        if m := pat.match(col):
            found[(names or {}).get(normalise(m["b"]), m["b"])] = col
    return found


# ---------------------------------------------------------------- building blocks


def _number(*values: Any) -> dict[str, Any]:
    return dict(zip(NUMBER_COLUMNS, values, strict=True))


def ours_rows(
    runs: pd.DataFrame, columns: dict[str, str], *, reps: int, seed: int
) -> tuple[list[tuple[str, dict[str, str]]], list[dict]]:
    """One display row per group (mean ± CI over its runs) for each (label -> runs column)."""
    rows, numbers = [], []
    groups = sorted(runs.groupby(GROUP), key=lambda t: (not str(t[0]).startswith("GRPO"), str(t[0])))
    for name, sub in groups:  # the GRPO baseline first
        label = f"{name} — ours, {len(sub)} seed{'s' if len(sub) != 1 else ''}"
        cells = {}
        for col_label, col in columns.items():
            vals = sub[col].dropna().to_numpy(float) if col in sub else np.array([])
            if len(vals) == 0:
                continue
            m, lo, hi = stats.bootstrap_ci(vals, reps=reps, seed=seed)
            cells[col_label] = fmt_ci(m, lo, hi) + (f" (n={len(vals)})" if len(vals) < len(sub) else "")
            numbers.append(_number(label, col_label, m * 100, lo * 100, hi * 100, len(vals), "%", "ours"))
        rows.append((label, cells))
    return rows, numbers


def gain_pairs(runs: pd.DataFrame) -> tuple[list[tuple[str, str]], list[str]]:
    """(EMA-PG variant, GRPO variant) pairs to compare, and notes on what could not be paired: each EMA-PG
    variant against the only GRPO variant, or else the one with the same KL configuration."""
    kl = ["kl_type", "kl_k", "kl_tail", "kl_coef"]
    first = runs.drop_duplicates(GROUP).set_index(GROUP)
    grpo = [v for v in first.index if first.at[v, "method"] == "GRPO"]
    pairs, notes = [], []
    for v in (v for v in first.index if first.at[v, "method"] == "EMA-PG"):
        alike = [g for g in grpo if all(same(first.at[g, k], first.at[v, k]) for k in kl if k in first)]
        base = grpo if len(grpo) == 1 else alike
        if len(base) == 1:
            pairs.append((v, base[0]))
        elif grpo:
            notes.append(f"no unambiguous GRPO baseline for {v}; its relative gain is not shown")
    return sorted(pairs), notes


def gain_rows(
    runs: pd.DataFrame, columns: dict[str, str]
) -> tuple[list[tuple[str, dict[str, str]]], list[dict], list[str]]:
    """Three rows per EMA-PG variant against its GRPO baseline: the relative gain of the seed means with the
    exact test's 95% CI, P(improvement), and the decision (`compare`; paired over the seeds both ran where they
    share at least two, else unpaired). Each gain cell says which: "(paired, n seeds)" or "(unpaired)"."""
    pairs, notes = gain_pairs(runs)
    rows, numbers = [], []
    for ema, base in pairs:
        g_cells, p_cells, d_cells, unpaired = {}, {}, {}, {}
        g_label, p_label = f"gain: {ema} vs {base}", f"P(improvement): {ema} > {base}"
        d_label = f"decision: {ema} vs {base}"
        for col_label, col in columns.items():
            got = compare(runs[runs[GROUP] == ema], runs[runs[GROUP] == base], col)
            if got is None:
                continue
            c, pairing, why = got
            (lo, hi), tag = c.ci, f" ({pairing})"
            g_cells[col_label] = fmt_gain(c.gain, lo, hi) + tag
            wins = f" ({c.poi * c.n:g} of {c.n} seeds)" if c.paired else ""
            p_cells[col_label] = f"{c.poi:.2f}{wins}"
            d_cells[col_label] = c.describe()
            src = f"ours ({pairing})"
            numbers += [
                _number(g_label, col_label, c.gain * 100, lo * 100, hi * 100, c.n, "% relative", src),
                _number(p_label, col_label, c.poi, math.nan, math.nan, c.n, "probability", src),
                _number(d_label, col_label, c.p, math.nan, math.nan, c.n, "p-value", src),
            ]
            if why:
                unpaired.setdefault(why, []).append(col_label)
        rows += [(g_label, g_cells), (p_label, p_cells), (d_label, d_cells)]
        notes += [f"{ema} vs {base}: unpaired for {', '.join(cs)}: {why}." for why, cs in unpaired.items()]
        fingerprints = runs[runs[GROUP].isin([ema, base])]["numerics"] if "numerics" in runs else pd.Series([])
        if fingerprints.dropna().nunique() > 1:
            notes.append(
                f"{ema} vs {base}: the runs compared computed under {fingerprints.dropna().nunique()} numerical "
                "fingerprints (the report's front page lists them): the gain may be partly the machine's."
            )
    return rows, numbers, notes + ([PAIRING_NOTE] if rows else [])


PAIRING_NOTE = (
    "gain, P(improvement) and decision: paired = over the seeds both methods ran on the same task and data "
    "settings (same warm start, data order and sampling streams); unpaired = the two share fewer than two such "
    "seeds. The decision is an exact permutation test of no difference (paired: the 2^n ways to swap each "
    "seed's two runs), at most 5% false 'clear' at any n; the gain's 95% CI is that test inverted, so it "
    "excludes 0 exactly when the decision is clear, and is unbounded (inf) where n is too small to bound it: "
    "a paired comparison needs at least 6 seeds to be clear at 95%. P(improvement): paired, the fraction of "
    "seeds on which EMA-PG beats GRPO (ties 1/2); unpaired, P(X > Y) over all pairs of runs. 'seeds for 80% "
    "power' plans the next sweep from the observed effect (a paired t-test's power). n = seeds paired, or runs "
    "of both methods."
)


def compare(xs: pd.DataFrame, ys: pd.DataFrame, col: str):
    """(stats.Comparison of runs `xs` against runs `ys` in `col`, pairing label, why unpaired or None): paired
    over the common seeds (`pair_by_seed`) when it can be, else unpaired over all runs. None when either side has
    no value or the baseline's mean is not positive."""
    x_all = xs[col].dropna().to_numpy(float) if col in xs else np.array([])
    y_all = ys[col].dropna().to_numpy(float) if col in ys else np.array([])
    if len(x_all) == 0 or len(y_all) == 0:
        return None
    x, y, why = pair_by_seed(xs, ys, col)
    if why is not None:
        x, y = x_all, y_all
    if np.mean(y) <= 0:
        return None
    c = stats.compare(x, y, paired=why is None)  # at its alpha, 0.05
    return c, (f"paired, {len(x)} seeds" if why is None else "unpaired"), why


def pair_by_seed(xs: pd.DataFrame, ys: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(x, y, None): the values of `col` of runs `xs` and `ys` on their common seeds, aligned
    (x[i] and y[i] from the same seed), or (empty, empty, reason) with fewer than two common seeds.

    A seed is common when each side has exactly one run with a value at that `seed` and `task`, and the two
    runs agree on every data setting (`cfg.task.*`: data seed, split sizes, task knobs; NaN equals NaN)."""
    empty = np.array([])
    if "seed" not in xs or "seed" not in ys:
        return empty, empty, "the runs have no seed column"
    keys = ["task", "seed"] if "task" in xs and "task" in ys else ["seed"]
    skip = ("cfg.task.name", "cfg.task.retriever_url")  # the `task` column; an address, not data
    data = [c for c in xs.columns if c.startswith("cfg.task.") and c in ys.columns and c not in skip]

    def one_per_seed(f: pd.DataFrame) -> pd.DataFrame:
        f = f.dropna(subset=[col, "seed"])
        return f.loc[~f.duplicated(keys, keep=False), [*keys, *data, col]]

    m = one_per_seed(xs).merge(one_per_seed(ys), on=keys, suffixes=("_x", "_y")).sort_values(keys)
    for c in data:
        a, b = m[f"{c}_x"], m[f"{c}_y"]
        m = m[(a == b) | (a.isna() & b.isna())]
    if len(m) < 2:
        n = f"{len(m)} seed" + ("" if len(m) == 1 else "s")
        return empty, empty, f"{n} in common with the same task and data settings (pairing needs 2)"
    return m[f"{col}_x"].to_numpy(float), m[f"{col}_y"].to_numpy(float), None


def paper_rows(setting: str, columns: Sequence[str]) -> tuple[list[tuple[str, dict[str, str]]], list[dict]]:
    """GRPO / EMA-PG rows with the paper's verified numbers, and the paper's relative gain row."""
    rows, numbers = [], []
    for method in ("GRPO", "EMA-PG"):
        label = f"{method} — paper"
        found = {c: p for c in columns if (p := paper.number(setting, c, method))}
        rows.append((label, {c: f"{p.value:.1f} {p.source}" for c, p in found.items()}))
        numbers += [_number(label, c, p.value, np.nan, np.nan, np.nan, "%", p.source) for c, p in found.items()]
    cells = {}
    for c in columns:
        reported = paper.number(setting, c, paper.GAIN)
        a, b = paper.number(setting, c, "EMA-PG"), paper.number(setting, c, "GRPO")
        if reported:
            cells[c], value, src = f"{reported.value:+.1f}% {reported.source}", reported.value, reported.source
        elif a and b:  # derived from two reported numbers: our arithmetic on the paper's values
            value, src = (a.value / b.value - 1) * 100, f"{a.source} (ratio computed here)"
            cells[c] = f"{value:+.1f}%"
        else:
            continue
        numbers.append(_number("gain: EMA-PG vs GRPO — paper", c, value, np.nan, np.nan, np.nan, "% relative", src))
    rows.append(("gain: EMA-PG vs GRPO — paper", cells))
    return rows, numbers


def assemble(
    name: str, caption: str, columns: Sequence[str], blocks: Sequence[tuple[list, list]], notes: Sequence[str] = ()
) -> Table:
    """Stack row blocks into a Table; missing cells are "—"."""
    rows = [r for block, _ in blocks for r in block]
    cells = pd.DataFrame(
        [[c.get(col, NA) for col in columns] for _, c in rows],
        index=pd.Index([label for label, _ in rows], name="method"),
        columns=list(columns),
    )
    numbers = pd.DataFrame([n for _, nums in blocks for n in nums], columns=NUMBER_COLUMNS)
    return Table(name, caption, cells, numbers, list(notes))


# ---------------------------------------------------------------- result tables


def paper_table(
    runs: pd.DataFrame, task: str, *, weights: dict[str, float] | None = None, reps: int = 2000, seed: int = 0
) -> Table:
    """The paper-format main table of a task that declares benchmarks: the paper's verified numbers (when the task
    names a setting of analysis.paper), ours per variant, then relative gains. `runs`: the runs to report.
    "Average" is the per-run mean over all benchmarks (weighted by `weights`, e.g. problem counts), shown only
    for runs that have every benchmark."""
    spec = reporting(task)
    if not spec.benchmarks:
        raise ValueError(f"task {task!r} declares no benchmarks (REPORTING.benchmarks): its table is tiny_table")
    benchmarks, metric = spec.benchmarks, spec.metrics[0]
    found = find_benchmarks(runs.columns, "final/eval/", metric, spec.names)
    runs = runs.assign(_avg=_average(runs, [found.get(b) for b in benchmarks], benchmarks, weights))
    columns = {**{b: found.get(b, f"final/eval/{b}/{metric}") for b in benchmarks}, "Average": "_avg"}
    published = f"Paper: {paper.SETTINGS[spec.paper]}. " if spec.paper else ""
    caption = (
        f"{task.capitalize()}: {METRIC_NAMES.get(metric, metric)} (%) at the final iteration. {published}"
        f"Ours: mean ± half-width of the 95% stratified-bootstrap CI "
        f"over seeds ({reps} resamples); gains: relative gain of seed means [95% CI of the exact permutation "
        f"test], paired or unpaired over seeds as marked, with the test's decision (see the notes). "
        f"— = unavailable (not reported in a verified source, or not logged)."
    )
    notes = [f"{tag}: {desc}" for tag, desc in paper.SOURCES.items()] if spec.paper else []
    weighted = "weighted by " + ", ".join(f"{k}={v:g}" for k, v in weights.items()) if weights else ""
    notes.append(f"Average = {weighted or 'unweighted mean over the benchmarks'}.")
    g_rows, g_nums, g_notes = gain_rows(runs, columns)
    blocks = [paper_rows(spec.paper, list(columns))] if spec.paper else []
    blocks += [ours_rows(runs, columns, reps=reps, seed=seed), (g_rows, g_nums)]
    return assemble(f"{task}_main", caption, columns, blocks, notes + g_notes)


# tiny_table's columns per benchmark: (label, eval prefix, metric)
TINY_COLUMNS = ("policy acc", "eval", "acc"), ("policy pass@1", "eval", "pass@1"), ("anchor acc", "eval_anchor", "acc")


def tiny_table(runs: pd.DataFrame, task: str, *, reps: int = 2000, seed: int = 0) -> Table:
    """The main table of a task without benchmarks (a tiny task): TINY_COLUMNS per benchmark, no paper rows."""
    names = reporting(task).names
    benches = sorted({b for m in ("acc", "pass@1") for b in find_benchmarks(runs.columns, "final/eval/", m, names)})
    columns: dict[str, str] = {}
    for b in benches:
        pre = f"{b} " if len(benches) > 1 else ""
        for kind, prefix, metric in TINY_COLUMNS:
            col = find_benchmarks(runs.columns, f"final/{prefix}/", metric, names).get(b)
            columns[pre + kind] = col or f"final/{prefix}/{b}/{metric}"
    caption = (
        f"{task}: accuracy (%) at the final iteration; acc = greedy, pass@1 = mean accuracy "
        f"over n samples; anchor = the EMA anchor (the fixed reference for GRPO). Mean ± "
        f"half-width of the 95% stratified-bootstrap CI over seeds ({reps} resamples). "
        f"— = not logged."
    )
    g_rows, g_nums, g_notes = gain_rows(runs, columns)
    blocks = [ours_rows(runs, columns, reps=reps, seed=seed), (g_rows, g_nums)]
    return assemble(f"{task}_main", caption, columns, blocks, g_notes)


def passk_table(
    evals: pd.DataFrame,
    task: str,
    *,
    reps: int = 2000,
    seed: int = 0,
    name: str | None = None,
    when: str = "at each run's last evaluated iteration",
) -> Table:
    """Unbiased pass@k (%) at each run's last evaluated iteration, per model (policy, anchor), averaged over problems
    and benchmarks, mean ± CI over seeds, from non-empty `evals`. `name` (default <task>_passk) and `when` (the
    caption's) serve the `emapg eval` table."""
    last = evals.groupby("run_id")["iteration"].transform("max")
    ev = evals[evals["iteration"] == last]
    ks = [k for k in PASS_KS if k <= int(ev["n"].min())]
    per = stats.pass_at_k_frame(ev, ks, by=("run_id", GROUP, "model"))  # one row per run and model
    wide = per.pivot_table(index=["run_id", GROUP], columns="model", values=[f"pass@{k}" for k in ks])
    wide.columns = [f"{m} {k}" for k, m in wide.columns]
    wide = wide.reset_index()
    models = sorted(per["model"].unique(), key=lambda m: (m != "policy", m))
    columns = {f"{m} pass@{k}": f"{m} pass@{k}" for m in models for k in ks}
    caption = (
        f"{task}: unbiased pass@k (%) from n samples per problem (Codex estimator), {when}, "
        f"mean over problems; mean ± half-width of the 95% bootstrap CI over seeds."
    )
    blocks = [ours_rows(wide, columns, reps=reps, seed=seed)]
    return assemble(name or f"{task}_passk", caption, columns, blocks)


ESTIMATOR_COLUMNS = {
    "estimator": "estimator",
    "direction": "direction",
    "tail": "tail",
    "k": "k",
    "value_bias": "value bias",
    "grad_bias": "gradient bias",
    "value_unbiased": "value unbiased",
    "grad_unbiased": "gradient unbiased",
    "variance": "value variance",
    "grad_variance": "gradient variance",
    "bytes_per_token": "bytes / token",
}


def estimator_table(rows: pd.DataFrame, meta: dict[str, Any] | None = None) -> Table:
    """The KL-estimator table (the paper's Table 1, extended) from audit records
    (analysis.audit_schema.ESTIMATOR_FIELDS)."""

    def show(col: str, v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return NA
        if col in ("value_unbiased", "grad_unbiased"):
            return "✓" if bool(v) else "✗"
        if col in ("value_bias", "grad_bias", "variance", "grad_variance"):
            return f"{float(v):.2e}"
        if col == "bytes_per_token":
            return f"{int(v):,}"
        return str(int(v)) if col == "k" else str(v)

    shown = {label: [show(c, v) for v in rows.get(c, [None] * len(rows))] for c, label in ESTIMATOR_COLUMNS.items()}
    cells = pd.DataFrame(shown).set_index("estimator")
    ctx = ", ".join(
        f"{k}={v}" for k, v in (meta or {}).items() if not isinstance(v, (dict, list)) and not k.startswith("stability")
    )
    caption = (
        "Token-level KL estimators: bias of the value and of the gradient, variance of each, "
        "and memory per token, as computed by ema_pg_core.audit"
        + (f" ({ctx})" if ctx else "")
        + ". ✓/✗: the audit's unbiasedness verdict; — = not reported."
    )
    return Table("kl_estimators", caption, cells, rows.copy())


RUN_COLUMNS = "run_id status truncated forced_resume task variant seed iterations_done config_hash wandb_run_id error"
UNHEALTHY_COLUMNS = "run_id task variant seed health_rule health_iteration health_message"


def runs_table(runs: pd.DataFrame) -> Table:
    """Every run found, with status and knobs (failed and partial runs included, flagged)."""
    return _listing(runs, RUN_COLUMNS, "runs", f"All {len(runs)} runs found (status as recorded).")


def unhealthy_table(runs: pd.DataFrame) -> Table:
    """The runs a health rule stopped (status stopped_unhealthy), which are in no number of the report."""
    caption = (
        f"{len(runs)} run(s) stopped by a health rule (status stopped_unhealthy): left out of every mean, CI, "
        "gain and curve; rule, iteration and values are in each run's summary.json."
    )
    return _listing(runs, UNHEALTHY_COLUMNS, "unhealthy", caption)


def _listing(runs: pd.DataFrame, columns: str, name: str, caption: str) -> Table:
    """A table of runs by id: those of the (space-separated) `columns` the frame has, "—" where a value is missing."""
    cols = [c for c in columns.split() if c in runs]
    cells = runs[cols].astype(object).where(runs[cols].notna(), NA).set_index("run_id")
    return Table(name, caption, cells, runs[cols])


def _average(
    runs: pd.DataFrame, cols: list[str | None], names: Sequence[str], weights: dict[str, float] | None
) -> pd.Series:
    if any(c is None for c in cols):
        return pd.Series(np.nan, index=runs.index)
    w = np.array([(weights or {}).get(n, 1.0) for n in names], dtype=float)
    vals = runs[cols].to_numpy(float)  # NaN where a run lacks a benchmark -> NaN average
    return pd.Series(vals @ w / w.sum(), index=runs.index)


def _with_index(df: pd.DataFrame) -> pd.DataFrame:
    return df.reset_index() if df.index.name or not isinstance(df.index, pd.RangeIndex) else df


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return NA
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def same(a: Any, b: Any) -> bool:
    """a == b, where two missing values (None, NaN) are the same and a missing one differs from any value."""
    return (pd.isna(a) and pd.isna(b)) if (pd.isna(a) or pd.isna(b)) else a == b
