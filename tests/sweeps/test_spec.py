"""Sweep specs: every shipped YAML validates (--dry-run), every bad spec is rejected with a message
naming the key and the allowed values. Fast: composes configs, never starts Ray."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import yaml

from sweeps import cli
from sweeps import spec as spec_mod
from sweeps.spec import SpecError, hydra_value, load, parse, table, trials

SWEEPS = sorted((Path(__file__).resolve().parents[2] / "sweeps").glob("*.yaml"))
GOOD = {
    "name": "t",
    "base": {"experiment": "math_tiny_ema_pg", "overrides": {"trainer.iterations": 4}},
    "space": {"algo.anchor.tau": {"grid": [1.0, 0.9]}},
    "seeds": [0, 1],
    "metric": "eval/math_tiny/acc",
}


def spec_with(**changes) -> dict:
    """GOOD with top-level keys replaced (None deletes the key)."""
    d = copy.deepcopy(GOOD)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def rejects(data, *fragments: str) -> str:
    with pytest.raises(SpecError) as e:
        parse(data)
    for f in fragments:
        assert f in str(e.value), f"{f!r} not in: {e.value}"
    return str(e.value)


# ------------------------------------------------------------------ shipped specs
def test_every_sweep_is_shipped():
    names = {p.stem for p in SWEEPS}
    assert {
        "quickstart",
        "ablate_tau",
        "ablate_period",
        "ablate_k",
        "ablate_kl_type",
        "tune_optuna",
        "math_deepscaler_ema_pg",
        "search_r1_ema_pg",
    } <= names


@functools.cache
def shipped(name: str):
    return load(SWEEPS[0].parent / f"{name}.yaml")


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_shipped_spec_passes_dry_run(path, capsys):
    assert cli.main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    spec = shipped(path.stem)
    assert f"sweep {spec.name}: {len(trials(spec))} trials" in out
    assert spec.name == path.stem  # the default output directory is named after the file


def test_dry_run_table_lists_every_trial():
    spec = shipped("quickstart")
    rows = trials(spec)
    assert [(r["experiment"], r["seed"]) for r in rows] == [
        (e, s) for s in spec.seeds for e in ("math_tiny_grpo", "math_tiny_ema_pg")
    ]
    assert "trial 0 runs: emapg train experiment=math_tiny_grpo" in table(spec)


def test_ablate_k_ends_at_the_tiny_vocabulary():
    from ema_pg_core.local.tiny import build_tokenizer

    spec = shipped("ablate_k")
    (k,) = [p for p in spec.space if p.keys == ("algo.kl.k",)]
    assert max(k.values) == len(build_tokenizer()) and 0 in k.values


def test_paper_ablation_values():
    by_name = {p.stem: shipped(p.stem) for p in SWEEPS}
    assert by_name["ablate_tau"].space[0].values == (1.0, 0.99, 0.95, 0.9, 0.8, 0.5)
    assert by_name["ablate_period"].space[0].values == (1, 5, 10, 20, 50)
    kl = {v[0] for v in by_name["ablate_kl_type"].space[0].values}
    assert {"k3", "k3++", "k4", "k5", "exact_forward", "exact_reverse", "topk_forward", "topk_reverse"} <= kl
    opt = by_name["tune_optuna"]
    assert opt.search == "optuna" and opt.scheduler.type == "asha"
    assert {k for p in opt.space for k in p.keys} == {
        "algo.anchor.tau",
        "algo.anchor.period",
        "algo.kl.k",
        "algo.kl.coef",
    }
    assert by_name["math_deepscaler_ema_pg"].backend == by_name["search_r1_ema_pg"].backend == "verl"


# ------------------------------------------------------------------ bad specs
def test_unknown_top_level_key():
    rejects(spec_with(metrc="x"), "unknown key metrc", "did you mean metric", "allowed: name, base, space")


def test_unknown_nested_key():
    rejects(spec_with(scheduler={"type": "asha", "grace": 2}), "unknown key scheduler.grace", "grace_period")
    rejects(spec_with(base={"experiment": "math_tiny_grpo", "override": {}}), "unknown key base.override", "overrides")


def test_unknown_config_path():
    rejects(
        spec_with(space={"algo.anchor.tua": {"grid": [1.0]}}),
        "space.algo.anchor.tua",
        "unknown config key",
        "did you mean algo.anchor.tau",
    )
    rejects(
        spec_with(base={"experiment": "math_tiny_grpo", "overrides": {"trainer.iteratons": 3}}),
        "base.overrides.trainer.iteratons",
        "trainer.iterations",
    )


def test_unknown_group_option():
    rejects(
        spec_with(space={"task": {"grid": ["math_tiny", "nope"]}}),
        "space.task",
        "'nope' is not a task option",
        "allowed: math, math_tiny, search, search_tiny",
    )
    rejects(spec_with(base={"experiment": "nope"}), "base.experiment='nope'", "math_tiny_ema_pg")


def test_section_is_not_a_value():
    rejects(spec_with(space={"algo.anchor": {"grid": [1]}}), "config section", "algo.anchor.tau")


def test_tau_out_of_range_in_a_grid():
    rejects(
        spec_with(space={"algo.anchor.tau": {"grid": [1.0, 1.5]}}),
        "algo.anchor.tau=1.5",
        "algo.anchor.tau must be in [0, 1]",
    )


def test_out_of_range_in_a_joint_grid_and_a_range_end():
    rejects(
        spec_with(space={"algo.kl.type,algo.kl.tail": {"grid": [["k3", "unbiased"], ["topk_reverse", "bogus"]]}}),
        "algo.kl.tail='bogus'",
        "allowed values: paper, unbiased, none",
    )
    rejects(
        spec_with(search="random", space={"algo.anchor.tau": {"uniform": [0.5, 1.2]}}),
        "algo.anchor.tau must be in [0, 1]",
    )


def test_wrong_type_value():
    rejects(spec_with(space={"algo.kl.k": {"grid": [1.5]}}), "algo.kl.k=1.5", "is not an integer")
    rejects(
        spec_with(search="random", space={"algo.anchor.period": {"uniform": [1, 5]}}),
        "algo.anchor.period is an integer; use int",
    )
    rejects(spec_with(search="random", space={"algo.kl.type": {"uniform": [0, 1]}}), "not numeric")


def test_empty_space():
    rejects(spec_with(space={}), "space is empty")
    rejects(spec_with(space=None), "space is empty")


def test_unknown_metric():
    msg = rejects(spec_with(metric="eval/math/acc"), "metric='eval/math/acc'", "did you mean eval/math_tiny/acc")
    assert "train/reward" in msg  # the allowed list
    rejects(spec_with(metric="best_eval/math_tiny/acx"), "best_eval/math_tiny/acx")


def test_real_tasks_offer_per_benchmark_and_task_average_metrics():
    for task, metric in [
        ("math", "eval/aime2024/pass@1"),
        ("math", "eval/math/pass@1"),
        ("search", "eval/nq/acc"),
        ("search", "eval/search/acc"),
        ("search", "best_eval_anchor/bamboogle/acc"),
    ]:
        parse(spec_with(base={"experiment": "math_tiny_ema_pg", "overrides": {"task": task}}, metric=metric))
    rejects(
        spec_with(base={"experiment": "math_tiny_ema_pg", "overrides": {"task": "search"}}, metric="eval/aime2024/acc"),
        "is not a metric the runs log",
    )


def test_metric_must_be_logged_by_every_task():
    rejects(
        spec_with(space={"task": {"grid": ["math_tiny", "search_tiny"]}}), "not logged by trials with task search_tiny"
    )
    parse(spec_with(space={"task": {"grid": ["math_tiny", "search_tiny"]}}, metric="train/reward"))
    parse(spec_with(metric="best_eval_anchor/math_tiny/pass@1"))


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"search": "bayes"}, ["search='bayes'", "allowed values: grid, random, optuna"]),
        ({"search": {"type": "optuna", "seed": "x"}}, ["search.seed"]),
        ({"scheduler": "hyperband"}, ["scheduler='hyperband'", "none, asha"]),
        ({"scheduler": {"type": "asha", "reduction_factor": 1}}, ["scheduler.reduction_factor", "> 1"]),
        ({"scheduler": {"type": "asha", "grace_period": 10}}, ["grace_period=10 exceeds max_t=4"]),
        (
            {"scheduler": {"type": "asha"}, "backend": "verl"},
            ["scheduler: asha stops trials mid-run", "scheduler: none"],
        ),
        ({"scheduler": {"type": "asha", "time_attr": "time_total_s"}}, ["scheduler.time_attr", "training_iteration"]),
        ({"mode": "maximize"}, ["mode='maximize'", "max, min"]),
        ({"backend": "slurm"}, ["backend='slurm'", "local, verl"]),
        (
            {"backend": "verl", "resources": {"cpu": 8, "gpu": 8}},
            ["resources: a verl trial reserves its whole verl job", "remove resources"],
        ),
        ({"budget": {"num_samples": 0}}, ["budget.num_samples", ">= 1"]),
        ({"budget": {"num_samples": 2}}, ["num_samples must be 1 with search: grid"]),
        ({"resources": {"cpu": 0}}, ["resources.cpu", "> 0"]),
        ({"resources": {"gpus": 1}}, ["unknown key resources.gpus", "did you mean resources.gpu"]),
        ({"max_concurrent": 0}, ["max_concurrent", ">= 1"]),
        ({"max_failures": -1}, ["max_failures", ">= 0"]),
        ({"seeds": []}, ["seeds must be a non-empty list"]),
        ({"seeds": [0, 0]}, ["seeds lists a seed twice"]),
        ({"name": "a b"}, ["name='a b'"]),
        ({"name": None}, ["`name` is required"]),
        ({"metric": None}, ["`metric` is required"]),
        ({"base": {"overrides": {}}}, ["base.experiment is required", "math_tiny_grpo"]),
        ({"base": {"experiment": "math_tiny_grpo", "overrides": {"seed": 3}}}, ["base.overrides.seed", "seeds"]),
        (
            {"base": {"experiment": "math_tiny_grpo", "overrides": {"run_dir": "x"}}},
            ["base.overrides.run_dir", "set by the sweep"],
        ),
        ({"base": {"experiment": "math_tiny_grpo", "overrides": {"backend": "verl"}}}, ["top-level `backend:`"]),
        (
            {"base": {"experiment": "math_tiny_grpo", "overrides": {"algo.kl.coef": -1.0}}},
            ["base:", "algo.kl.coef (beta) must be >= 0"],
        ),
        ({"space": {"algo.anchor.tau": {"grid": [1.0], "choice": [1.0]}}}, ["exactly one of: grid, choice, uniform"]),
        ({"space": {"algo.anchor.tau": {"range": [0, 1]}}}, ["exactly one of"]),
        ({"space": {"algo.anchor.tau": {"grid": []}}}, ["space.algo.anchor.tau.grid must be a non-empty list"]),
        ({"space": {"algo.anchor.tau": {"grid": [0.9, 0.9]}}}, ["lists a value twice"]),
        ({"space": {"algo.anchor.tau": {"grid": [1, 1.0]}}}, ["lists a value twice"]),  # both compose to tau=1.0
        ({"space": {"algo.kl.type,algo.anchor.tau": {"grid": [["k3", 1], ["k3", 1.0]]}}}, ["lists a value twice"]),
        ({"space": {"algo.anchor.tau": {"choice": [0.9, 1.0]}}}, ["choice needs search: random or optuna"]),
        ({"search": "random", "space": {"algo.anchor.tau": {"uniform": [1.0, 0.5]}}}, ["low < high"]),
        ({"search": "random", "space": {"algo.kl.coef": {"loguniform": [0, 0.1]}}}, ["loguniform needs low > 0"]),
        (
            {"search": "random", "space": {"algo.anchor.period": {"int": [1, 2.5]}}},
            ["space.algo.anchor.period.int[1] must be an integer; got 2.5"],
        ),
        (
            {"search": "optuna", "space": {"algo.anchor.tau": {"grid": [1.0]}}},
            ["grid is not supported by search: optuna"],
        ),
        ({"space": {"algo.kl.type,algo.kl.tail": {"grid": [["k3"]]}}}, ["list of 2 (one per key)"]),
        ({"space": {"algo.kl.type,algo.kl.type": {"grid": [["k3", "k3"]]}}}, ["joint keys must be distinct"]),
        (
            {"space": {"algo.kl.type": {"grid": ["k3"]}, "algo.kl.type,algo.kl.tail": {"grid": [["k3", "paper"]]}}},
            ["algo.kl.type appears in more than one entry"],
        ),
        (
            {
                "space": {"trainer.iterations": {"grid": [3]}},
                "base": {"experiment": "math_tiny_grpo", "overrides": {"trainer.iterations": 4}},
            },
            ["also fixed in base.overrides"],
        ),
        ({"space": {"seed": {"grid": [0, 1]}}}, ["`seed` is in space and `seeds` is given"]),
        ({"space": {"sweep.name": {"grid": ["x"]}}}, ["set by the sweep itself"]),
    ],
)
def test_bad_spec_is_rejected(changes, fragments):
    rejects(spec_with(**changes), *fragments)


def test_load_names_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(spec_with(metric="nope")))
    with pytest.raises(SpecError, match=r"bad\.yaml: metric='nope'"):
        load(p)
    p.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load(p)
    with pytest.raises(SpecError, match="no such sweep spec"):
        load(tmp_path / "missing.yaml")


def test_cli_reports_a_bad_spec_in_one_line(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(spec_with(space={"algo.anchor.tau": {"grid": [1.5]}})))
    assert cli.main([str(p), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("emapg sweep: error:") and "algo.anchor.tau must be in [0, 1]" in err and "\n" not in err


# ------------------------------------------------------------------ what a trial runs
def test_trial_overrides_compose_to_the_point():
    from experiments import build

    spec = parse(
        spec_with(
            space={"algo.kl.type,algo.kl.tail": {"grid": [["k3++", "none"]]}, "task": {"grid": ["search_tiny"]}},
            metric="train/reward",
            resources={"cpu": 2},
        )
    )
    cfg = build.compose(spec.overrides_for({"algo.kl.type": "k3++", "algo.kl.tail": "none", "task": "search_tiny"}, 7))
    assert (cfg.algo.kl.type, cfg.algo.kl.tail, cfg.task.name, cfg.seed) == ("k3++", "none", "search_tiny", 7)
    assert (cfg.sweep.name, cfg.logger.group, cfg.trainer.threads, cfg.trainer.iterations) == ("t", "t", 2, 4)
    assert list(cfg.logger.tags) == ["sweep:t", "type=k3++", "tail=none", "task=search_tiny"]


def test_dict_overrides_merge_into_the_config():
    from experiments import build

    spec = parse(spec_with(base={"experiment": "math_tiny_grpo", "overrides": {"task.knobs": {"digits": 2}}}))
    cfg = build.compose(spec.overrides_for({"algo.anchor.tau": 1.0}, 0))
    assert dict(cfg.task.knobs) == {"digits": 2}


@pytest.mark.parametrize(
    "value", ["plain", "k3++", "with space", 'quo"te', "back\\slash", "end\\", "0.9", "true", "a:b"]
)
def test_hydra_value_round_trips_strings(value):
    from experiments import build

    assert build.compose([f"run_dir={hydra_value(value)}"]).run_dir == value


def test_sampled_spaces_list_one_row_per_sample_and_seed():
    spec = parse(
        spec_with(
            search={"type": "optuna", "seed": 3},
            budget={"num_samples": 3},
            space={"algo.anchor.tau": {"uniform": [0.5, 1.0]}, "algo.kl.k": {"choice": [4, 32]}},
        )
    )
    rows = trials(spec)
    assert (
        len(rows) == 6
        and rows[0]["algo.anchor.tau"] == "~uniform(0.5, 1.0)"
        and rows[0]["algo.kl.k"] == "~choice[4, 32]"
    )
    assert "search=optuna (seed 3)" in table(spec)


def test_spec_and_cli_import_no_ray():
    """sweeps.tune is the only module importing ray; a --dry-run never starts (or imports) it."""
    import subprocess
    import sys

    code = (
        "import sys, sweeps.spec, sweeps.cli\n"
        "sweeps.cli.main([sys.argv[1], '--dry-run'])\n"
        "print('RAY' if 'ray' in sys.modules else 'NO_RAY')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(SWEEPS[0].parent / "quickstart.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO_RAY")


# ------------------------------------------------------------------ refused at --dry-run, not in a trial
TOPK = {"experiment": "math_tiny_ema_pg", "overrides": {"algo.kl.type": "topk_reverse"}}
TINY = "the tiny model (100 tokens)"


def hf_dir(tmp_path, vocab: int | None = 50) -> str:
    """A local 'HF model' holding only config.json (vocab_size); None: an empty directory."""
    d = tmp_path / f"hf_model_{vocab}"
    d.mkdir(exist_ok=True)
    if vocab is not None:
        (d / "config.json").write_text(f'{{"model_type": "qwen2", "vocab_size": {vocab}}}')
    return str(d)


def dry_run(tmp_path, capsys, text: str, main=cli.main, prefix=()) -> tuple[int, str, str]:
    """(exit code, stderr, path) of `emapg sweep <a YAML of text> --dry-run`."""
    path = tmp_path / "s.yaml"
    path.write_text(text.replace("HF_DIR", hf_dir(tmp_path)).replace("EMPTY_DIR", hf_dir(tmp_path, None)))
    code = main([*prefix, str(path), "--dry-run"])
    return code, capsys.readouterr().err, str(path)


def spec_yaml(**changes) -> str:
    return yaml.safe_dump(spec_with(**changes), sort_keys=False)


GRID_1E6 = {
    k: {"grid": list(range(1, 11))}
    for k in (
        "algo.anchor.period",
        "algo.kl.k",
        "algo.kl.coef",
        "trainer.eval_every",
        "rollout.group_size",
        "rollout.prompts_per_iter",
    )
}


@pytest.mark.parametrize(
    "text, fragments",
    [
        (
            spec_yaml(base=TOPK, space={"algo.kl.k": {"grid": [4, 99999]}}),
            [
                "algo.kl.k=99999 exceeds the vocabulary of " + TINY,
                "trials with algo.kl.k=99999",
                "needs 0 <= algo.kl.k <= 100",
            ],
        ),
        (
            spec_yaml(
                base={"experiment": "math_tiny_ema_pg", "overrides": {"algo.kl.k": 101}},
                space={"algo.kl.type": {"grid": ["k3", "topk_forward"]}},
            ),
            ["algo.kl.k=101 exceeds", TINY, "trials with algo.kl.type=topk_forward"],
        ),
        (
            spec_yaml(base=TOPK, space={"algo.kl.k": {"grid": [101]}, "algo.anchor.tau": {"grid": [1.0, 0.9]}}),
            ["algo.kl.k=101 exceeds", TINY],
        ),
        (
            spec_yaml(base=TOPK, search="random", space={"algo.kl.k": {"int": [1, 200]}}),
            ["algo.kl.k=200 exceeds", TINY],
        ),
        (
            spec_yaml(
                base={"experiment": "math_tiny_ema_pg"},
                space={"algo.kl.type,algo.kl.k": {"grid": [["k3", 500], ["topk_reverse", 32], ["topk_forward", 500]]}},
            ),
            ["algo.kl.k=500 exceeds", "algo.kl.type=topk_forward"],
        ),
        (
            spec_yaml(
                base={"experiment": "math_tiny_ema_pg", "overrides": {"model.path": "HF_DIR"}},
                space={"algo.kl.k": {"grid": [32, 64]}},
            ),
            ["algo.kl.k=64 exceeds the vocabulary of model.path=", "(50 tokens)"],
        ),
        (
            spec_yaml(base={"experiment": "math_tiny_ema_pg", "overrides": {"model.path": "EMPTY_DIR"}}),
            ["model.path=", "has no readable config.json"],
        ),
        (
            "name: t\nbase: {experiment: math_tiny_ema_pg}\nseeds: [0]\nspace: {seed: {grid: [0]}}\nseeds: [1]\n"
            "metric: train/reward\n",
            ["duplicate key seeds at lines 3 and 5"],
        ),
        (
            "name: t\nbase:\n  experiment: math_tiny_ema_pg\n  overrides:\n    algo.kl.k: 4\n    algo.kl.k: 8\n"
            "space: {algo.anchor.tau: {grid: [1.0]}}\nmetric: train/reward\n",
            ["duplicate key algo.kl.k at lines 5 and 6"],
        ),
        (
            "name: t\nbase: {experiment: math_tiny_ema_pg}\nspace: {algo.anchor.tau: {grid: [1.0], grid: [0.9]}}\n"
            "metric: train/reward\n",
            ["duplicate key grid at lines 3 and 3"],
        ),
        (
            spec_yaml(space={"algo.anchor.tau": {"grid": [1.0, 0.9]}, "algo.kl.k": {"grid": [1, 2]}}, max_trials=7),
            ["the grid has 8 trials (2 x 2 x 2 seeds), over max_trials=7; narrow the grid or raise max_trials"],
        ),
        (
            spec_yaml(space=GRID_1E6, seeds=[0]),
            ["the grid has 1,000,000 trials (10 x 10 x 10 x 10 x 10 x 10 x 1 seed), over max_trials=10000"],
        ),
        (
            spec_yaml(
                search="random",
                seeds=[0],
                budget={"num_samples": 10001},
                space={"algo.anchor.tau": {"uniform": [0.5, 1.0]}},
            ),
            ["the sweep has 10,001 trials (1 seed x 10001 samples), over max_trials=10000", "budget.num_samples"],
        ),
        (spec_yaml(max_trials=0), ["max_trials must be an integer >= 1"]),
    ],
    ids=[
        "k-grid",
        "k-base-type-grid",
        "k-product",
        "k-int-range",
        "k-joint",
        "k-hf-config",
        "hf-no-config",
        "dup-top-level",
        "dup-nested",
        "dup-flow",
        "over-max-trials",
        "grid-1e6",
        "num-samples",
        "max-trials-0",
    ],
)
def test_dry_run_refuses_what_a_trial_would_fail_on(tmp_path, capsys, monkeypatch, text, fragments):
    def never(*args, **kwargs):
        raise AssertionError("the sweep's trials were enumerated")

    if "max_trials" in " ".join(fragments):  # counted from the axis sizes: nothing enumerated or composed
        for name in ("grid_points", "trials", "_check_points", "check"):
            monkeypatch.setattr(spec_mod, name, never)
    code, err, path = dry_run(tmp_path, capsys, text)
    assert code == 2, err
    assert err.startswith(f"emapg sweep: error: {path}: ") and err.count("\n") == 1 and "Traceback" not in err
    for f in fragments:
        assert f in err, f"{f!r} not in: {err}"


@pytest.mark.parametrize(
    "text",
    [
        spec_yaml(base=TOPK, space={"algo.kl.k": {"grid": [0, 32, 100]}}),  # k = |V| is the exact KL
        spec_yaml(
            base={"experiment": "math_tiny_ema_pg", "overrides": {"algo.kl.k": 10**6}},
            space={"algo.kl.type": {"grid": ["k3", "exact_reverse"]}},
        ),  # k unused by these estimators
        spec_yaml(
            base={"experiment": "math_tiny_ema_pg", "overrides": {"model.path": "HF_DIR"}},
            space={"algo.kl.k": {"grid": [1, 50]}},
        ),
        spec_yaml(space={"algo.anchor.tau": {"grid": [1.0, 0.9]}, "algo.kl.k": {"grid": [1, 2]}}, max_trials=8),
        "name: t\nbase: {<<: {experiment: math_tiny_ema_pg}, experiment: math_tiny_grpo}\n"
        "space: {algo.anchor.tau: {grid: [1.0]}}\nmetric: train/reward\n",  # a merged key may be overridden
    ],
    ids=["k-up-to-vocab", "k-unused", "k-within-hf-config", "at-max-trials", "merge-key"],
)
def test_dry_run_accepts(tmp_path, capsys, text):
    code, err, _ = dry_run(tmp_path, capsys, text)
    assert code == 0, err


def test_emapg_sweep_refuses_k_above_the_vocabulary(tmp_path, capsys):
    from experiments import cli as emapg

    code, err, _ = dry_run(
        tmp_path, capsys, spec_yaml(base=TOPK, space={"algo.kl.k": {"grid": [101]}}), main=emapg.main, prefix=("sweep",)
    )
    assert code == 2 and err.startswith("emapg sweep: error:") and "algo.kl.k=101 exceeds" in err


def test_vocab_size_reads_configs_only(tmp_path):
    from ema_pg_core.local.tiny import build_tokenizer
    from experiments import build

    assert build.vocab_size(build.compose(["experiment=search_tiny_ema_pg"])) == len(build_tokenizer())
    assert build.vocab_size(build.compose([f"model.path={hf_dir(tmp_path, 77)}"])) == 77
    hub_id = build.compose(["experiment=search_r1_ema_pg", "model.path=no-such-org/no-such-model"])
    assert build.vocab_size(hub_id) is None  # not on this machine: verl downloads it, nothing to check here


# ------------------------------------------------------------------ hostile files: aliases, bytes, directories
def _bomb(levels: int = 9) -> str:
    """A billion-laughs value in flow style: level i lists nine aliases of level i-1 (9**levels ones)."""
    text = "[&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"
    for i in range(1, levels):
        text += f", &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]"
    return text + "]"


BOMB_SPEC = "name: bomb\nbase: BASE\nspace: {algo.anchor.tau: {grid: GRID}}\nseeds: SEEDS\nmetric: train/reward\n"
PLAIN = {"BASE": "{experiment: math_tiny_ema_pg}", "GRID": "[1.0, 0.9]", "SEEDS": "[0]"}


@pytest.mark.timeout(60)  # a guard: on a loader that expands the aliases this runs for minutes
@pytest.mark.parametrize(
    "where,value",
    [
        ("SEEDS", _bomb()),
        ("GRID", _bomb()),
        ("BASE", "{experiment: math_tiny_ema_pg, overrides: {trainer.iterations: " + _bomb() + "}}"),
    ],
    ids=["seeds", "grid", "base-overrides"],
)
def test_yaml_aliases_are_refused_before_validation(tmp_path, capsys, where, value):
    text = BOMB_SPEC
    for key, plain in {**PLAIN, where: value}.items():
        text = text.replace(key, plain)
    code, err, path = dry_run(tmp_path, capsys, text)
    assert code == 2, err
    assert err.startswith(f"emapg sweep: error: {path}: ") and err.count("\n") == 1, err
    assert "alias *l0" in err and "line" in err and len(err) < 400, err


def test_a_single_alias_is_refused_too(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(spec_yaml(seeds=[0, 1]).replace("seeds:", "seeds: &s") + "x_seeds: *s\n")
    with pytest.raises(SpecError, match=r"s\.yaml: line \d+, column \d+: YAML alias \*s: aliases are not allowed"):
        load(p)


def test_binary_directory_and_broken_files_are_named_in_one_line(tmp_path, capsys):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: x\n\xf8\xff\x00\x01 not text")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [x\nbase: {")
    control = tmp_path / "control.yaml"
    control.write_text("name: x\n\x00\x01 foo")
    for path, words in (
        (binary, ["not a text file", "byte 0xf8 at offset 8"]),
        (folder, ["is a directory"]),
        (broken, ["not valid YAML", "line 2, column 5"]),
        (control, ["not valid YAML", "unacceptable character #x0000"]),
    ):
        assert cli.main([str(path), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"emapg sweep: error: {path}: ") and err.count("\n") == 1, err
        for w in words:
            assert w in err, err


def test_error_messages_bound_the_values_they_show():
    """A value is shown at most errors.SHOWN_CHARS long, however large (here 2 MB of seeds)."""
    from experiments.errors import SHOWN_CHARS

    message = rejects(spec_with(seeds=["s" * 10**6] * 2), "seeds[0] must be an integer in [0, ")
    assert len(message) < SHOWN_CHARS + 200, len(message)
    message = rejects(spec_with(seeds={"x" * 10**6: 1}), "unknown key seeds.'xxxx", "allowed: adaptive")
    assert len(message) < SHOWN_CHARS + 200, len(message)
    message = rejects(spec_with(base=list(range(10**6))), "base must be a mapping")
    assert len(message) < SHOWN_CHARS + 200, len(message)
