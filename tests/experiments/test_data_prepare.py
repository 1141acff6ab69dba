"""`emapg data prepare {math,search}`: from a local copy of the sources (`--from`, in the documented
layout, built here from a few rows in each source's real schema) to verl parquet that the tasks'
`load` reads back; the summary's row counts; the hub's offline error; bad inputs (one line, exit 2).
No network: the hub loaders are replaced where a test reaches them."""

from __future__ import annotations

import importlib.util
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from experiments.cli import main
from experiments.ops import data
from experiments.tasks import math as m
from experiments.tasks import search as s

MATH = {  # name -> rows in the source's own schema (extra columns as the hub has them)
    "deepscaler": [
        {"problem": "What is $1+1$?", "answer": "2", "solution": "..."},
        {"problem": " Compute $\\frac{1}{2}+\\frac{1}{4}$. ", "answer": "\\frac{3}{4}", "solution": "..."},
    ],
    "aime2024": [{"problem": "Find $x$ if $x^2=49$ and $x>0$.", "answer": "7", "id": 60}],
    "amc": [{"question": "What is $3 \\cdot 4$?", "answer": "12"}, {"question": "What is $5-2$?", "answer": "3"}],
    "math500": [{"problem": "Convert $(0,3)$ to polar coordinates.", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)"}],
    "minerva": [{"question": "Give $2^{10}$.", "answer": "1024"}],
    "olympiad_bench": [{"question": "Solve $x^2=4$.", "final_answer": ["$2$", "$-2$"], "id": 7}],
}
MATH_FORMAT = {"amc": "jsonl", "minerva": "jsonl"}  # the rest parquet

SEARCH_SPLITS = {"popqa": "test", "hotpotqa": "dev", "2wikimultihopqa": "dev", "musique": "dev"}
"""The split each test set is stored as here (others: test), to exercise Search-R1's test > dev > train."""


def _write(path, rows: list[dict], fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), str(path) + ".parquet")
    else:
        (path.parent / f"{path.name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def math_sources(root) -> None:
    for name, (dataset, config, split, _, _) in m.SOURCES.items():
        base = root / dataset.replace("/", "__") / (config or "")
        _write(base / split, MATH[name], MATH_FORMAT.get(name, "parquet"))


def search_rows(source: str, split: str, n: int) -> list[dict]:
    return [
        {"id": f"{split}_{i}", "question": f"where is {source} {split} {i}", "golden_answers": [f"Paris {i}", "P"]}
        for i in range(n)
    ]


def search_sources(root) -> None:
    base = root / "RUC-NLPIR__FlashRAG_datasets"
    for src in s.TRAIN_SOURCES:
        _write(base / src / "train", search_rows(src, "train", 3), "jsonl" if src == "nq" else "parquet")
    for i, src in enumerate(s.TEST_SOURCES):
        split = SEARCH_SPLITS.get(src, "test")
        _write(base / src / split, search_rows(src, split, 1 + i % 2), "parquet" if i % 2 else "jsonl")


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _counts(out: str) -> dict[str, int]:
    """{file stem: rows} from the summary table."""
    return {
        m_.group(1): int(m_.group(2).replace(",", "")) for m_ in re.finditer(r"^  (\S+)\.parquet +([\d,]+)$", out, re.M)
    }


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("EMAPG_PROGRESS", "0")


def test_math_from_a_local_copy(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EMAPG_PROGRESS", "1")  # one bar per source, on stderr
    math_sources(tmp_path / "src")
    out_dir = tmp_path / "out"
    code, out, err = _run(["data", "prepare", "math", "--from", str(tmp_path / "src"), "--out", str(out_dir)], capsys)
    assert code == 0, err
    want = {"train": 2, "test": 6, "val": 1, "aime2024": 1, "amc": 2, "math500": 1, "minerva": 1, "olympiad_bench": 1}
    assert _counts(out) == want
    assert {p.stem: pq.read_metadata(p).num_rows for p in out_dir.glob("*.parquet")} == want
    assert "amc (opencompass/LiveMathBench v202412_AMC_en)" in err and "2/2" in err
    assert f"backend.verl.train_files={out_dir}/train.parquet backend.verl.val_files={out_dir}/val.parquet" in out
    assert f"+task.knobs.data_dir={out_dir}" in out

    train = {e.id: e for e in m.load("train", n=10, data_dir=str(out_dir))}
    assert set(train) == {"math/deepscaler/0", "math/deepscaler/1"}
    assert train["math/deepscaler/1"].prompt == "Compute $\\frac{1}{2}+\\frac{1}{4}$."
    assert train["math/deepscaler/1"].answer == ["\\frac{3}{4}"]
    (olympiad,) = m.load("olympiad_bench", n=10, data_dir=str(out_dir))
    assert (olympiad.id, olympiad.answer) == ("math/olympiad_bench/0", ["$2$", "$-2$"])  # a list stays a list
    amc = m.load("amc", n=10, data_dir=str(out_dir))  # read from JSONL
    assert sorted((e.id, e.prompt, e.answer[0]) for e in amc) == [
        ("math/amc/0", "What is $3 \\cdot 4$?", "12"),
        ("math/amc/1", "What is $5-2$?", "3"),
    ]
    assert [e.meta["source"] for e in m.load("val", n=10, data_dir=str(out_dir))] == ["aime2024"]


def test_search_from_a_local_copy(tmp_path, capsys):
    search_sources(tmp_path / "src")
    out_dir = tmp_path / "out"
    code, out, err = _run(["data", "prepare", "search", "--from", str(tmp_path / "src"), "--out", str(out_dir)], capsys)
    assert code == 0, err
    n_test = sum(1 + i % 2 for i in range(len(s.TEST_SOURCES)))
    assert _counts(out) == {"train": 6, "test": n_test}
    assert f"backend.verl.val_files={out_dir}/test.parquet" in out

    train = {e.id: e for e in s.load("train", n=10, data_dir=str(out_dir))}
    assert set(train) == {f"search/{src}/train/{i}" for src in s.TRAIN_SOURCES for i in range(3)}
    ex = train["search/hotpotqa/train/2"]
    assert ex.prompt == s.format_question("where is hotpotqa train 2") and ex.answer == ["Paris 2", "P"]
    test = s.load("test", n=100, data_dir=str(out_dir))
    assert len(test) == n_test and {e.meta["source"] for e in test} == set(s.TEST_SOURCES)
    musique = [e for e in test if e.meta["source"] == "musique"]  # stored as dev: read as the test set
    assert musique and musique[0].prompt.endswith("Question: where is musique dev 0?\n")
    assert s.evaluate(musique[0], "<answer> paris 0 </answer>") == 1


def test_the_default_directory_needs_no_override(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    search_sources(tmp_path / "src")
    code, out, err = _run(
        ["data", "prepare", "search", "--from", str(tmp_path / "src"), "--out", "~/data/emapg/search"], capsys
    )
    assert code == 0, err
    assert (tmp_path / "data/emapg/search/train.parquet").is_file()
    assert "no override needed" in out and "backend.verl.train_files" not in out


def test_from_the_hub_with_a_stand_in_loader(tmp_path, capsys, monkeypatch):
    """The hub path: the task's hf_loader (here a stand-in, no network); a source without the split is skipped."""
    monkeypatch.setattr(data, "_require_datasets", lambda: None)
    monkeypatch.setattr(s, "hf_loader", lambda src, split: None if src == "bamboogle" else search_rows(src, split, 2))
    code, out, err = _run(["data", "prepare", "search", "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert _counts(out) == {"train": 4, "test": 2 * (len(s.TEST_SOURCES) - 1)}
    assert "search/popqa/test/1" in {e.id for e in s.load("test", n=100, data_dir=str(tmp_path / "out"))}


def _offline(monkeypatch):
    """The hub as it answers with HF_HUB_OFFLINE=1: `datasets` raises ConnectionError (its message)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(data, "_require_datasets", lambda: None)  # `datasets` need not be installed here

    def unreachable(path):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(m, "hf_loader", lambda name: unreachable(m.SOURCES[name][0]))
    monkeypatch.setattr(s, "hf_loader", lambda source, split: unreachable(s.FLASHRAG))


@pytest.mark.parametrize(
    "task,words",
    [("math", ["agentica-org/DeepScaleR-Preview-Dataset"]), ("search", ["RUC-NLPIR/FlashRAG_datasets (config nq)"])],
)
def test_an_unreachable_hub_is_one_line_naming_the_dataset(task, words, tmp_path, capsys, monkeypatch):
    _offline(monkeypatch)
    code, out, err = _run(["data", "prepare", task, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    for word in [*words, "HF_HUB_OFFLINE", "ConnectionError", "--from SRC"]:
        assert word in err, err


def test_without_datasets_the_message_says_install_it_or_use_from(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else find_spec(name, *a)
    )
    code, out, err = _run(["data", "prepare", "math", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "pip install 'datasets>=3'" in err and "--from SRC" in err
    assert not (tmp_path / "out").exists()


def test_a_bug_in_a_loader_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    _offline(monkeypatch)
    monkeypatch.setattr(m, "hf_loader", lambda name: 1 / 0)
    code, out, err = _run(["data", "prepare", "math", "--out", str(tmp_path / "out")], capsys)
    assert code == 1 and "ZeroDivisionError" in err and "Traceback" in err


def _bad_sources(tmp) -> None:
    (tmp / "a_file").write_text("x\n")
    math_sources(tmp / "partial")
    (tmp / "partial/math-ai__minervamath/test.jsonl").unlink()
    math_sources(tmp / "badjson")
    (tmp / "badjson/math-ai__minervamath/test.jsonl").write_text('{"question": "q", "answer": "1"}\n{"question": \n')
    math_sources(tmp / "nocol")
    _write(tmp / "nocol/HuggingFaceH4__MATH-500/test", [{"problem": "p", "solution": "s"}], "parquet")


BAD = [
    (["nope", "--out", "{tmp}/o"], ["task 'nope' is not a task", "math, search"]),
    (["math_tiny", "--out", "{tmp}/o"], ["'math_tiny' has no data to prepare"]),
    (["math", "--out", "{tmp}/a_file", "--from", "{tmp}/partial"], ["--out", "a_file", "not a directory"]),
    (["math", "--out", "{tmp}/o", "--from", "{tmp}/missing"], ["--from", "missing", "no such directory"]),
    (["math", "--out", "{tmp}/o", "--from", "{tmp}/partial"], ["missing math-ai__minervamath/test.{parquet,jsonl}"]),
    (["search", "--out", "{tmp}/o", "--from", "{tmp}/partial"], ["nq/train.{parquet,jsonl}", "nq/{test,dev,train}"]),
    (["math", "--out", "{tmp}/o", "--from", "{tmp}/badjson"], ["minervamath/test.jsonl:2", "not JSON"]),
    (["math", "--out", "{tmp}/o", "--from", "{tmp}/nocol"], ["MATH-500/test.parquet", "row 1 has no column answer"]),
]


@pytest.mark.parametrize("argv,words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2(argv, words, tmp_path, capsys):
    _bad_sources(tmp_path)
    argv = ["data", "prepare", *(a.replace("{tmp}", str(tmp_path)) for a in argv)]
    code, out, err = _run(argv, capsys)
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("emapg data: error: "), err
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_the_help_lists_every_source_file(capsys):
    code, out, err = _run(["data", "prepare", "--help"], capsys)
    assert code == 0
    assert "SRC/opencompass__LiveMathBench/v202412_AMC_en/test.{parquet,jsonl}" in out
    assert "SRC/RUC-NLPIR__FlashRAG_datasets/bamboogle/{test,dev,train}.{parquet,jsonl}" in out
