"""index.md / index.html / provenance.json for a report directory: the front page and where its numbers
came from (run ids, config hashes, W&B run ids, or audit metadata).

The front page has one section per `Output.section` (a task, "All runs", ...): each table inline with
links to its .md/.tex/.csv, each figure as a picture, and the section's provenance once, collapsed (a
`<details>` in index.html, a footnote in index.md). provenance.json lists it in full per output."""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.tables import to_markdown

MAX_LISTED = 10  # ids listed inline per output; the full lists are in provenance.json
ID_LISTS = {"run_ids": "runs", "config_hashes": "config hashes", "wandb_run_ids": "W&B runs"}  # run_provenance's


@dataclass
class Output:
    """One table or figure of a report."""

    kind: str  # "table" | "figure"
    title: str  # one line
    paths: list[Path]
    provenance: dict[str, Any] = field(default_factory=dict)
    cells: pd.DataFrame | None = None  # a table's display cells, inlined on the front page
    section: str = ""  # front-page section (e.g. the task); "" = "Outputs"
    notes: list[str] = field(default_factory=list)  # a table's notes, shown below it


def run_provenance(runs: pd.DataFrame) -> dict[str, list[str]]:
    """Run ids, distinct config hashes and W&B run ids of the runs behind an output."""
    columns = {"run_ids": "run_id", "config_hashes": "config_hash", "wandb_run_ids": "wandb_run_id"}
    return {key: sorted({str(v) for v in runs[col].dropna()}) if col in runs else [] for key, col in columns.items()}


def write_index(out_dir: Path, title: str, header: list[str], outputs: list[Output], skipped: list[str]) -> list[Path]:
    """Write index.md, index.html and provenance.json into `out_dir`; returns every file of the output (the
    outputs' files, then these three)."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [*header, f"Generated {stamp}."]
    paths = [out_dir / "index.md", out_dir / "index.html", out_dir / "provenance.json"]
    paths[0].write_text(_markdown(out_dir, title, header, outputs, skipped), encoding="utf-8")
    paths[1].write_text(_html(out_dir, title, header, outputs, skipped), encoding="utf-8")
    prov = [{"title": o.title, "files": [_rel(p, out_dir) for p in o.paths], **o.provenance} for o in outputs]
    paths[2].write_text(json.dumps({"outputs": prov, "skipped": skipped}, indent=1, default=str), encoding="utf-8")
    return [p for o in outputs for p in o.paths] + paths


def provenance_text(prov: dict[str, Any]) -> str:
    """One line: "runs (3): a, b, c; config hashes: ...; W&B: ..." or the audit metadata."""
    parts = []
    for key, name in ID_LISTS.items():
        vals = prov.get(key) or []
        if vals:
            shown = ", ".join(vals[:MAX_LISTED])
            more = f", … {len(vals) - MAX_LISTED} more (provenance.json)" if len(vals) > MAX_LISTED else ""
            parts.append(f"{name} ({len(vals)}): {shown}{more}")
    parts += [f"{key}: {value}" for key, value in prov.items() if key not in ID_LISTS]
    return "; ".join(parts) or "—"


def _sections(outputs: list[Output]) -> list[tuple[str, list[Output], list[str]]]:
    """(heading, outputs, distinct provenance lines) per section, in order of first appearance; tables
    before figures within a section. The outputs of a section usually share one provenance."""
    grouped: dict[str, list[Output]] = {}
    for o in outputs:
        grouped.setdefault(o.section or "Outputs", []).append(o)
    out = []
    for name, items in grouped.items():
        items = sorted(items, key=lambda o: o.kind != "table")  # stable: keeps the order within a kind
        out.append((name, items, list(dict.fromkeys(provenance_text(o.provenance) for o in items))))
    return out


def _markdown(out_dir: Path, title: str, header: list[str], outputs: list[Output], skipped: list[str]) -> str:
    lines = [f"# {title}", "", *[f"{h}  " for h in header], ""]
    count = 0
    for name, items, notes in _sections(outputs):
        refs = {text: f"[^{count + i}]" for i, text in enumerate(notes, 1)}
        count += len(notes)
        lines += [f"## {name}", ""]
        if len(notes) == 1:
            lines += [f"Provenance of this section: {refs[notes[0]]}", ""]
        for o in items:
            own = refs[provenance_text(o.provenance)] if len(notes) > 1 else ""
            lines += _markdown_output(out_dir, o, own)
        lines += [f"{ref}: {text}" for text, ref in refs.items()] + [""]
    lines += ["## Skipped", ""] + ([f"- {s}" for s in skipped] or ["- nothing"]) + [""]
    return "\n".join(lines)


def _markdown_output(out_dir: Path, o: Output, ref: str) -> list[str]:
    """One output: its title, file links (and `ref`, its own footnote), the table or the picture."""
    links = ", ".join(f"[{p.suffix[1:]}]({_rel(p, out_dir)})" for p in o.paths)
    lines = [f"### {o.title}", "", f"Files: {links}{ref}", ""]
    if o.cells is not None:
        lines += [to_markdown(o.cells).rstrip("\n"), ""]
    if o.notes:
        lines += [f"- {n}" for n in o.notes] + [""]
    if png := [p for p in o.paths if p.suffix == ".png"]:
        lines += [f"![{o.title}]({_rel(png[0], out_dir)})", ""]
    return lines


def _html(out_dir: Path, title: str, header: list[str], outputs: list[Output], skipped: list[str]) -> str:
    e = html.escape
    body = [f"<h1>{e(title)}</h1>", *[f"<p>{e(h)}</p>" for h in header]]
    for name, items, notes in _sections(outputs):
        body.append(f"<h2>{e(name)}</h2>")
        for o in items:
            links = " ".join(f'<a href="{e(_rel(p, out_dir))}">{e(p.suffix[1:])}</a>' for p in o.paths)
            body.append(f"<section><h3>{e(o.title)}</h3><p>{links}</p>")
            if o.cells is not None:
                body.append(o.cells.to_html(escape=True, border=0, classes="tbl"))
            if o.notes:
                body.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in o.notes) + "</ul>")
            if png := [p for p in o.paths if p.suffix == ".png"]:
                body.append(f'<img src="{e(_rel(png[0], out_dir))}" alt="{e(o.title)}">')
            if len(notes) > 1:
                body.append(_details(provenance_text(o.provenance)))
            body.append("</section>")
        if len(notes) == 1:
            body.append(_details(notes[0]))
    body.append("<h2>Skipped</h2><ul>" + "".join(f"<li>{e(s)}</li>" for s in skipped or ["nothing"]) + "</ul>")
    css = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}img{max-width:100%;"
        "border:1px solid #ddd}.prov{color:#555;font-size:.85em}table.tbl{border-collapse:collapse;font-size:.85em}"
        ".tbl td,.tbl th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}.tbl th{text-align:left}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
        f"<style>{css}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _details(text: str) -> str:
    return f'<details class="prov"><summary>provenance</summary>{html.escape(text)}</details>'


def _rel(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()
