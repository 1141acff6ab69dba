"""The reasons live in the repo: no file points to design notes the repo does not ship, no file names
a path on one developer's machine, and every docs/*.md that README.md or docs/ mentions exists.

The method is explained in docs/algorithm.md, the verl plugin in docs/verl-plugin.md, and the
layout in docs/architecture.md; code and tests point there (or to a public URL) instead.

README.md is what a newcomer reads in five minutes (at most README_MAX_LINES lines): the two commands
first, the quickstart's output, its sweep YAML (kept equal to sweeps/quickstart.yaml), the report, what
ran on a GPU, and a link to every doc. Every relative link, and every #anchor, in README.md and docs/*.md
resolves; docs/sweeps.md's key list is the one in sweeps/spec.py and names every shipped sweep.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.repo import git_files

ROOT = Path(__file__).resolve().parents[1]

# Spelled in pieces so that this file passes its own check.
UNSHIPPED_NOTES = [
    "ema-pg" + ".md",
    "verl-0.9" + ".md",
    "style" + ".md",
    "shared" + "/spec",
    "../" + "shared",
    "\u00a7",
]
"""Names of the unshipped design notes (and the section sign their references carried)."""
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:" + "work" + "|" + "root" + r")/|(?<![\w.~-])/(?:home|Users)/[A-Za-z_]")
"""An absolute path on a developer's machine: under work, root, home/<user> or Users/<user>."""
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
"""Public URLs may contain anything; they are removed before the machine-path check."""
DOCS_MENTION = re.compile(r"(?<![\w./-])docs/[\w./-]+\.md")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
README_MAX_LINES = 150


def repo_files() -> list[Path]:
    """Tracked files plus new, not ignored ones (`git ls-files`), that exist."""
    return [ROOT / p for p in git_files(untracked=True)]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def offences(text: str) -> list[tuple[int, str]]:
    """(line number, what) for every reference to an unshipped note or a machine path in `text`."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for name in UNSHIPPED_NOTES:
            if name in line:
                found.append((n, f"refers to {name!r}, which the repo does not ship"))
        for m in MACHINE_PATH.finditer(URL.sub("", line)):
            found.append((n, f"machine path {m.group(0)!r}..."))
    return found


def test_no_reference_to_unshipped_notes_or_machine_paths():
    bad = []
    for path in repo_files():
        text = text_of(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT).as_posix()
        bad += [f"{rel}:{n}: {what}" for n, what in offences(text)]
    assert not bad, (
        "point to docs/algorithm.md, docs/verl-plugin.md, docs/architecture.md or a public URL, "
        "or explain inline:\n" + "\n".join(bad)
    )


def test_the_check_catches_what_it_should():
    sign = "\u00a7"
    assert offences(f"see {UNSHIPPED_NOTES[0]} {sign}1.5") and offences("x = '/" + "work/shared/a'")
    assert offences("/" + "root/.cache") and offences("cd /home/" + "alice/emapg")
    assert not offences("https://example.org/" + "work/x and http://h/home/" + "bob")
    assert not offences("outputs/work/x ~/emapg $HOME/emapg /nfs/sweeps docs/algorithm.md")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's ids for the headings of a Markdown file (outside code blocks): lower case, punctuation
    dropped, spaces to hyphens, a repeated id suffixed -1, -2, ..."""
    ids: set[str] = set()
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M):
        base = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in ids:
            n += 1
            slug = f"{base}-{n}"
        ids.add(slug)
    return ids


def link_problem(page: Path, link: str) -> str | None:
    """Why a relative Markdown link on `page` does not resolve (missing file or #anchor), else None."""
    target, _, anchor = link.partition("#")
    if re.match(r"[a-z][a-z0-9+.-]*:", target):
        return None  # a URL
    path = (page.parent / target) if target else page
    if not path.exists():
        return f"link target {link} does not exist"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"link {link}: no heading with the id #{anchor} in {path.name}"
    return None


def test_the_anchor_ids_are_githubs(tmp_path):
    page = tmp_path / "p.md"
    text = "# A\n## What ran on a GPU, and what did not\n```\n# not a heading\n```\n## Check it: `emapg doctor`\n"
    page.write_text(text + "### W&B runs\n## β × τ\n## A\n", encoding="utf-8")
    ids = {"a", "what-ran-on-a-gpu-and-what-did-not", "check-it-emapg-doctor", "wb-runs", "β--τ", "a-1"}
    assert anchors(page) == ids
    assert link_problem(page, "#wb-runs") is None and link_problem(page, "p.md#a-1") is None
    assert "no heading" in link_problem(page, "#not-a-heading") and "does not exist" in link_problem(page, "q.md")
    assert link_problem(page, "https://example.org/x#y") is None


def test_docs_links_resolve():
    bad = []
    for path in markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in DOCS_MENTION.finditer(line):
                if not (ROOT / m.group(0)).is_file():
                    bad.append(f"{rel}:{n}: {m.group(0)} does not exist")
            for m in MD_LINK.finditer(line):
                problem = link_problem(path, m.group(1))
                if problem:
                    bad.append(f"{rel}:{n}: {problem}")
    assert not bad, "\n".join(bad)


def test_the_three_docs_exist_and_readme_links_them():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in ("algorithm", "verl-plugin", "architecture"):
        assert (ROOT / "docs" / f"{name}.md").is_file()
        assert f"docs/{name}.md" in readme


def readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_short_and_starts_with_the_two_commands():
    text = readme()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md: move detail to docs/ (<= {README_MAX_LINES} lines)"
    lang, first = FENCE.search(text).groups()
    assert text.startswith("# emapg\n\n```bash\n") and lang == "bash"
    assert [x.split("#")[0].strip() for x in first.splitlines()] == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "make test" in ci  # CI runs the README's test command
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M).group(1)
    assert "emapg sweep sweeps/quickstart.yaml" in demo
    assert "\n## What ran on a GPU\n" in text


def test_readme_links_every_doc():
    linked = {m.group(1) for m in MD_LINK.finditer(readme())}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md's 'Where to go next' should link {missing}"


def test_readme_sweep_yaml_is_the_quickstart():
    blocks = [body for lang, body in FENCE.findall(readme()) if lang == "yaml"]
    assert len(blocks) == 1
    shipped = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text(encoding="utf-8"))
    assert yaml.safe_load(blocks[0]) == shipped, "README's sweep YAML differs from sweeps/quickstart.yaml"


def test_sweeps_doc_lists_every_key_and_every_shipped_sweep():
    from sweeps import spec

    text = (ROOT / "docs" / "sweeps.md").read_text(encoding="utf-8")
    blocks = [body for lang, body in FENCE.findall(text) if lang == "yaml"]
    assert len(blocks) == 1 and tuple(yaml.safe_load(blocks[0])) == spec.SPEC_KEYS
    missing = [p.stem for p in sorted((ROOT / "sweeps").glob("*.yaml")) if f"`{p.stem}`" not in text]
    assert not missing, f"docs/sweeps.md, 'Shipped sweeps': add {missing}"
