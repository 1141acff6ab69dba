"""index.md / index.html / provenance.json for a report directory: every output with a one-line
caption and where its numbers came from (run ids, config hashes, W&B run ids, or audit metadata)."""
from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

MAX_LISTED = 10  # ids listed inline per output; the full lists are in provenance.json


@dataclass
class Output:
    """One table or figure of a report."""

    kind: str                               # "table" | "figure"
    title: str                              # one line
    paths: list[Path]
    provenance: dict[str, Any] = field(default_factory=dict)
    cells: pd.DataFrame | None = None       # a table's display cells, inlined in index.html


def run_provenance(runs: pd.DataFrame) -> dict[str, list[str]]:
    """Run ids, distinct config hashes and W&B run ids of the runs behind an output."""
    def ids(col: str) -> list[str]:
        return sorted({str(v) for v in runs[col].dropna()}) if col in runs else []
    return {"run_ids": ids("run_id"), "config_hashes": ids("config_hash"),
            "wandb_run_ids": ids("wandb_run_id")}


def write_index(out_dir: Path, title: str, header: list[str], outputs: list[Output],
                skipped: list[str]) -> list[Path]:
    """Write index.md, index.html and provenance.json into `out_dir`; returns their paths."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [*header, f"Generated {stamp}."]
    paths = [out_dir / "index.md", out_dir / "index.html", out_dir / "provenance.json"]
    paths[0].write_text(_markdown(out_dir, title, header, outputs, skipped), encoding="utf-8")
    paths[1].write_text(_html(out_dir, title, header, outputs, skipped), encoding="utf-8")
    prov = [{"title": o.title, "files": [_rel(p, out_dir) for p in o.paths], **o.provenance}
            for o in outputs]
    paths[2].write_text(json.dumps({"outputs": prov, "skipped": skipped}, indent=1, default=str),
                        encoding="utf-8")
    return paths


def provenance_text(prov: dict[str, Any]) -> str:
    """One line: "runs (3): a, b, c; config hashes: ...; W&B: ..." or the audit metadata."""
    parts = []
    for key, name in (("run_ids", "runs"), ("config_hashes", "config hashes"), ("wandb_run_ids", "W&B runs")):
        vals = prov.get(key) or []
        if vals:
            shown = ", ".join(vals[:MAX_LISTED])
            more = f", … {len(vals) - MAX_LISTED} more (provenance.json)" if len(vals) > MAX_LISTED else ""
            parts.append(f"{name} ({len(vals)}): {shown}{more}")
    for key, value in prov.items():
        if key not in ("run_ids", "config_hashes", "wandb_run_ids"):
            parts.append(f"{key}: {value}")
    return "; ".join(parts) or "—"


def _markdown(out_dir: Path, title: str, header: list[str], outputs: list[Output],
              skipped: list[str]) -> str:
    lines = [f"# {title}", "", *[f"{h}  " for h in header], ""]
    for kind, heading in (("table", "Tables"), ("figure", "Figures")):
        items = [o for o in outputs if o.kind == kind]
        if not items:
            continue
        lines += [f"## {heading}", ""]
        for o in items:
            links = ", ".join(f"[{p.suffix[1:]}]({_rel(p, out_dir)})" for p in o.paths)
            lines.append(f"- **{o.title}** ({links})  ")
            lines.append(f"  provenance: {provenance_text(o.provenance)}")
            if kind == "figure" and any(p.suffix == ".png" for p in o.paths):
                png = next(p for p in o.paths if p.suffix == ".png")
                lines.append(f"\n  ![{o.title}]({_rel(png, out_dir)})")
        lines.append("")
    lines += ["## Skipped", ""] + ([f"- {s}" for s in skipped] or ["- nothing"]) + [""]
    return "\n".join(lines)


def _html(out_dir: Path, title: str, header: list[str], outputs: list[Output],
          skipped: list[str]) -> str:
    e = html.escape
    body = [f"<h1>{e(title)}</h1>", *[f"<p>{e(h)}</p>" for h in header]]
    for kind, heading in (("table", "Tables"), ("figure", "Figures")):
        items = [o for o in outputs if o.kind == kind]
        if items:
            body.append(f"<h2>{heading}</h2>")
        for o in items:
            links = " ".join(f'<a href="{e(_rel(p, out_dir))}">{e(p.suffix[1:])}</a>' for p in o.paths)
            body.append(f"<section><h3>{e(o.title)}</h3><p>{links}</p>")
            if o.cells is not None:
                body.append(o.cells.to_html(escape=True, border=0, classes="tbl"))
            png = [p for p in o.paths if p.suffix == ".png"]
            if png:
                body.append(f'<img src="{e(_rel(png[0], out_dir))}" alt="{e(o.title)}">')
            body.append(f'<p class="prov">provenance: {e(provenance_text(o.provenance))}</p></section>')
    body.append("<h2>Skipped</h2><ul>" + "".join(f"<li>{e(s)}</li>" for s in skipped or ["nothing"]) + "</ul>")
    css = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
           "img{max-width:100%;border:1px solid #ddd}.prov{color:#555;font-size:.85em}"
           "table.tbl{border-collapse:collapse;font-size:.85em}"
           ".tbl td,.tbl th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
           ".tbl th{text-align:left}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
            f"<style>{css}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _rel(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()
