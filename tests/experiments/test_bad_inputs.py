"""Every bad input gets one clear message and exit code 2, before any work, with no traceback.

Each row: an `emapg` command line (``{tmp}`` is a fresh directory; files it needs are made by
`_setup`), and the words the message must contain (the field, file or option at fault). Commands
run in-process through the CLI's one error path (``experiments.cli.main``).
"""

from __future__ import annotations

import json

import pytest
import yaml

from experiments.cli import main

TRAIN = ["logger.name=none", "smoke=true"]  # were a case to pass by mistake, it would train seconds, not minutes

CASES = [
    # ---- emapg train: Hydra composition
    (["train", "trainer.iteratons=5"], ["trainer.iteratons", "did you mean trainer.iterations"]),
    (["train", "seed=abc"], ["seed", "'abc' is not an integer"]),
    (["train", "task=nope"], ["task='nope'", "allowed: math, math_tiny, search, search_tiny"]),
    (["train", "task=math_tin"], ["did you mean math_tiny"]),
    (["train", "algo.kl.name=nope"], ["algo.kl.name is not a config key", "keys of algo.kl"]),
    (["train", "+foo=1"], ["foo is not a config key"]),
    (["train", "+algo.kl.foo=1"], ["algo.kl.foo is not a config key"]),
    (["train", "trainr.iterations=3"], ["did you mean trainer"]),
    (["train", "trainer=5"], ["trainer:", "set its keys"]),
    (["train", "algo.kl.k=[1,2]"], ["algo.kl.k", "not an integer"]),
    (["train", "trainer.iterations="], ["trainer.iterations"]),
    (["train", "algo.kl.coef=abc"], ["algo.kl.coef", "not a number"]),
    (["train", "smoke=maybe"], ["smoke", "true or false"]),
    (["train", "a=b=c"], ["cannot parse the override"]),
    (["train", "task.knobs.digits=3"], ["+task.knobs.digits"]),
    (["train", "oops"], ["key=value", "oops"]),
    (["train", "experiment=nope"], ["experiment preset 'nope'"]),
    # ---- emapg train: validation of values
    (["train", "trainer.device=tpu9"], ["trainer.device='tpu9'", "cpu, cuda, cuda:N, auto"]),
    (["train", "trainer.device=cuda"], ["trainer.device='cuda'", "CUDA is not available"]),
    (["train", "model=hf"], ["model=hf needs model.path"]),
    (["train", "model.path={tmp}/nope"], ["model.path="]),
    (["train", "resume=yes"], ["resume='yes'", "false, true, auto, force"]),
    (["train", "algo.kl.type=k9"], ["algo.kl.type='k9'"]),
    (["train", "algo.kl.k=1000"], ["algo.kl.k=1000", "vocabulary", "100"]),
    (["train", "algo.kl.tail=maybe"], ["algo.kl.tail"]),
    (["train", "algo.anchor.tau=1.5"], ["algo.anchor.tau"]),
    (["train", "algo.anchor.period=0"], ["algo.anchor.period"]),
    (["train", "rollout.group_size=1"], ["rollout.group_size"]),
    (["train", "trainer.dtype=float8"], ["trainer.dtype"]),
    (["train", "trainer.probe_every=-1"], ["trainer.probe_every", "0 = no KL probe"]),
    (["train", "trainer.probe_size=0"], ["trainer.probe_size", ">= 1"]),
    (["train", "logger.mode=loud"], ["logger.mode"]),
    (["train", "backend.name=tpu"], ["backend.name"]),
    (["train", "run_dir={tmp}/a_file"], ["a_file", "not a directory"]),
    (["train", "run_dir={tmp}/finished"], ["finished", "resume=true"]),
    (["train", "run_dir={tmp}/bad_ckpt", "resume=true"], ["no intact checkpoint", "latest is empty"]),
    # ---- emapg train: numeric domains, sizes and seeds (issue #28)
    (["train", "trainer.eval_temperature=-1"], ["trainer.eval_temperature must be >= 0 (0 = greedy)"]),
    (["train", "rollout.temperature=0"], ["rollout.temperature must be > 0", "trainer.eval_temperature=0"]),
    (["train", "algo.loss.log_ratio_clamp=-1"], ["algo.loss.log_ratio_clamp must be > 0"]),
    (["train", "algo.kl.iw_clip_high=-1"], ["algo.kl.iw_clip_high must be > 0 or null"]),
    (["train", "rollout.max_obs_tokens=-5"], ["rollout.max_obs_tokens must be an integer >= 1"]),
    (["train", "algo.kl.coef=inf"], ["algo.kl.coef", "must be a finite number >= 0", "got inf"]),
    (["train", "algo.anchor.tau=nan"], ["algo.anchor.tau must be a finite number in [0, 1]"]),
    (["train", "trainer.mini_batches=3"], ["trainer.mini_batches=3 must divide", "2 x 2 = 4", "allowed: 1, 2, 4"]),
    (["train", "trainer.mini_batches=8"], ["trainer.mini_batches=8 must divide", "= 4 sequences"]),
    (["train", "trainer.keep_checkpoints=0"], ["trainer.keep_checkpoints must be an integer >= 1"]),
    (["train", "trainer.probe_size=9"], ["trainer.probe_size=9 exceeds the held-out split", "task.test_size=8"]),
    (["train", "trainer.eval_size=9"], ["trainer.eval_size=9 exceeds the held-out split", "task.test_size=8"]),
    (["train", "trainer.eval_size=0"], ["trainer.eval_size must be an integer >= 1"]),
    (["train", "trainer.threads=0"], ["trainer.threads must be an integer >= 1"]),
    (["train", "optim.beta1=1.5"], ["optim.beta1 must be in [0, 1); got 1.5"]),
    (["train", "optim.weight_decay=-5"], ["optim.weight_decay must be >= 0; got -5"]),
    (["train", "task.train_size=0"], ["task.train_size must be an integer >= 1"]),
    (["train", "model.heads=3"], ["model.hidden=128 must be divisible by model.heads=3"]),
    (["train", "seed=12345678901234567890"], ["seed must be an integer in [0, 4294967295]"]),
    (["train", "seed=-1"], ["seed must be an integer in [0, 4294967295]"]),
    (["train", "task.data_seed=4294967296"], ["task.data_seed must be an integer in [0, 4294967295]"]),
    (["train", "run_dir={tmp}/" + "r" * 300], ["run_dir", "300 bytes long", "at most 255"]),
    (["train", "run_dir={tmp}/my run (1)"], ["cannot parse the override", "quote its value", 'run_dir="']),
    (["train", "run_dir={tmp}/nope", "resume=true"], ["resume=true", "nope", "holds no run", "resume=auto"]),
    (["train", "run_dir={tmp}/empty", "resume=force"], ["resume=force", "empty", "holds no run"]),
    (["train", "task=search_tiny", "task.retriever_url=http://127.0.0.1:1"], ["task.retriever_url", "not reachable"]),
    (["train", "task=search_tiny", "task.retriever_url=ftp://x"], ["task.retriever_url='ftp://x'", "http://"]),
    # ---- emapg train: health rules (one case per field)
    (["train", "health.entropy_floor.floor=0"], ["health.entropy_floor.floor must be > 0 or null"]),
    (["train", "health.entropy_floor.floor=abc"], ["health.entropy_floor.floor", "not a number"]),
    (["train", "health.entropy_floor.patience=0"], ["health.entropy_floor.patience must be an integer >= 1"]),
    (["train", "health.kl_spike.factor=0.5"], ["health.kl_spike.factor must be > 1 or null"]),
    (["train", "health.kl_spike.window=0"], ["health.kl_spike.window must be an integer >= 1"]),
    (["train", "health.kl_spike.factor=5", "algo.kl.coef=0"], ["health.kl_spike.factor=5", "algo.kl.coef=0"]),
    (["train", "health.kl_spike.min_history=50"], ["health.kl_spike.min_history", "[1, health.kl_spike.window=20]"]),
    (["train", "health.length_cap.frac=1.5"], ["health.length_cap.frac must be in (0, 1] or null"]),
    (["train", "health.length_cap.patience=-1"], ["health.length_cap.patience must be an integer >= 1"]),
    (["train", "health.kl_spike.factr=3"], ["health.kl_spike.factr", "did you mean health.kl_spike.factor"]),
    (["train", "health.nonfinite=false"], ["health.nonfinite is not a config key"]),
    (
        ["train", "run_dir={tmp}/unhealthy", "resume=true", "trainer.iterations=8"],
        ["stopped by health rule kl_spike at iteration 7", "relax"],
    ),
    # ---- emapg sweep --dry-run
    (["sweep", "{tmp}/missing.yaml", "--dry-run"], ["missing.yaml", "no such sweep spec"]),
    (["sweep", "{tmp}/dup.yaml", "--dry-run"], ["dup.yaml", "duplicate key", "lines"]),
    (["sweep", "{tmp}/huge.yaml", "--dry-run"], ["1,000,000 trials", "max_trials"]),
    (["sweep", "{tmp}/big_k.yaml", "--dry-run"], ["algo.kl.k=5000", "vocabulary"]),
    (["sweep", "{tmp}/typo.yaml", "--dry-run"], ["typo.yaml", "trainer.iteratons"]),
    (["sweep", "{tmp}/a_file", "--dry-run"], ["a_file", "must be a mapping"]),
    (["sweep", "{tmp}/health_value.yaml", "--dry-run"], ["health_value.yaml", "health.kl_spike.factor must be > 1"]),
    (["sweep", "{tmp}/health_rule.yaml", "--dry-run"], ["unknown key health.entropy", "did you mean"]),
    (["sweep", "{tmp}/health_base.yaml", "--dry-run"], ["base.overrides.health.kl_spike.factor", "`health:` key"]),
    (["sweep", "{tmp}/binary.yaml", "--dry-run"], ["binary.yaml", "not a text file"]),
    (["sweep", "{tmp}/empty", "--dry-run"], ["empty", "is a directory"]),
    (["sweep", "{tmp}/alias.yaml", "--dry-run"], ["alias.yaml", "line 4", "alias *n", "not allowed"]),
    (["sweep", "{tmp}/inf_range.yaml", "--dry-run"], ["space.algo.kl.coef.uniform[1] must be a finite number", "inf"]),
    (["sweep", "{tmp}/big_seed.yaml", "--dry-run"], ["seeds[1] must be an integer in [0, 4294967295]"]),
    (["sweep", "{tmp}/long_name.yaml", "--dry-run"], ["name=", "1 to 58", "W&B tag"]),
    (["sweep", "{tmp}/seed_axis.yaml", "--dry-run"], ["seed must be an integer in [0, 4294967295]"]),
    # ---- emapg report
    (["report", "{tmp}/nope", "--out", "{tmp}/out"], ["not a directory", "nope"]),
    (["report", "{tmp}/a_file", "--out", "{tmp}/out"], ["a_file"]),
    (["report", "{tmp}/empty", "--out", "{tmp}/out"], ["no run records"]),
    (["report", "{tmp}/corrupt", "--out", "{tmp}/out"], ["metrics.jsonl:2", "corrupt"]),
    (["report", "{tmp}/empty", "--out", "{tmp}/out", "--reps", "0"], ["--reps", "integer >= 1"]),
    # ---- emapg eval
    (["eval", "{tmp}/run", "--benchmarks", "aime"], ["--benchmarks", "'aime'", "allowed: math_tiny"]),
    (["eval", "{tmp}/run", "--protocol", "nope"], ["--protocol 'nope'", "readme, benchmark, in_training"]),
    (["eval", "{tmp}/model", "--task", "nope"], ["--task 'nope'", "allowed: math, math_tiny"]),
    (["eval", "{tmp}/model"], ["model directory", "--task"]),
    (["eval", "{tmp}/empty"], ["empty", "not a run directory", "checkpoint", "Hugging Face model"]),
    (["eval", "{tmp}/run", "--n", "0"], ["--n=0", "integer >= 1"]),
    (["eval", "{tmp}/run", "--top-p", "1.5"], ["--top-p=1.5", "(0, 1]"]),
    (["eval", "{tmp}/vrun"], ["verl run", "model_merger"]),
    # ---- emapg train: staged runs
    (["train", "stage=16k", "experiment=math_tiny_ema_pg"], ["stage='16k'", "math_tiny has no stages"]),
    (["train", "stages=[8k]"], ["stages[0]='8k'", "not a stage of task math_tiny"]),
    (["train", "experiment=math_deepscaler_ema_pg", "stage=32k"], ["stage='32k'", "allowed: 8k, 16k, 24k"]),
    (["train", "experiment=math_deepscaler_ema_pg", "stages=[8k,16k,24k]"], ["stage '24k'", "trainer.iterations"]),
    (["train", "stages=[{name: a, set: {trainer.iteratons: 2}}]"], ["stage 'a'", "trainer.iteratons"]),
    (["train", "resume_from={tmp}/empty"], ["resume_from needs stage"]),
    (["train", "experiment=math_deepscaler_ema_pg", "stage=16k", "resume_from={tmp}/empty"], ["resume_from", "verl"]),
    # ---- emapg retriever
    (["retriever", "serve", "--port", "99999"], ["--port", "0-65535"]),
    (["retriever", "serve", "--task", "nope"], ["unknown task 'nope'"]),
    (["retriever", "serve", "--corpus", "{tmp}/nope.jsonl"], ["--corpus", "nope.jsonl"]),
    (["retriever", "index", "--corpus", "{tmp}/nope.jsonl", "--out", "{tmp}/i"], ["--corpus", "nope.jsonl"]),
    (["retriever", "serve", "--corpus", "{tmp}/binary.yaml"], ["--corpus", "binary.yaml", "not a text file"]),
    (["retriever", "index", "--corpus", "{tmp}/binary.yaml", "--out", "{tmp}/i"], ["--corpus", "not a text file"]),
    # ---- emapg cluster
    (["cluster", "submit"], ["give a sweep spec"]),
    (["cluster", "slurm", "--site", "{tmp}/site.yaml", "--nodes", "0"], ["--nodes must be >= 1"]),
    (["cluster", "slurm", "--site", "{tmp}/nope.yaml"], ["nope.yaml"]),
    (["cluster", "slurm", "--site", "{tmp}/alias_site.yaml"], ["alias_site.yaml", "alias *g", "not allowed"]),
    (["cluster", "slurm", "--site", "{tmp}/binary.yaml"], ["binary.yaml", "not a text file"]),
    (["cluster", "list", "--address", "not-a-url"], ["not-a-url"]),
]


def _setup(tmp) -> None:
    """The files the cases point at."""
    import torch

    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "empty").mkdir()
    for name, backend in (("run", "local"), ("vrun", "verl")):  # a run with a final policy (nothing is loaded)
        (tmp / name / "final" / "policy").mkdir(parents=True)
        (tmp / name / "config.yaml").write_text(
            yaml.safe_dump({"task": {"name": "math_tiny"}, "backend": {"name": backend}})
        )
        (tmp / name / "status").write_text("finished\n")
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    corrupt = tmp / "corrupt" / "r"
    corrupt.mkdir(parents=True)
    (corrupt / "config.yaml").write_text("task: {name: math_tiny}\nseed: 0\n")
    (corrupt / "status").write_text("finished\n")
    (corrupt / "metrics.jsonl").write_text('{"iteration": 0}\n{"iter\n{"iteration": 2}\n')
    finished = tmp / "finished"
    finished.mkdir()
    (finished / "status").write_text("finished\n")
    bad = tmp / "bad_ckpt"
    (bad / "checkpoints").mkdir(parents=True)
    (bad / "checkpoints" / "latest").write_text("")
    (bad / "metrics.jsonl").write_text('{"iteration": 0, "time_s": 0.0}\n')
    (tmp / "dup.yaml").write_text(
        "name: dup\nmetric: eval/math_tiny/acc\nbase:\n  experiment: math_tiny_ema_pg\n"
        "  trainer.iterations: 2\n  trainer.iterations: 3\n"
    )
    axes = {f"rollout.{k}": list(range(1, 11)) for k in ("max_new_tokens", "max_obs_tokens", "max_turns")}
    axes.update({f"trainer.{k}": list(range(1, 11)) for k in ("eval_every", "eval_size", "save_every")})
    _spec(tmp / "huge.yaml", "huge", {k: {"grid": v} for k, v in axes.items()})
    _spec(tmp / "big_k.yaml", "big_k", {"algo.kl.k": {"grid": [32, 5000]}})
    (tmp / "typo.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "typo",
                "metric": "eval/math_tiny/acc",
                "base": {"experiment": "math_tiny_ema_pg", "trainer.iteratons": 2},
            }
        )
    )
    unhealthy = tmp / "unhealthy"  # stopped by a health rule after iteration 7, a checkpoint at 5
    (unhealthy / "checkpoints" / "iter_000005").mkdir(parents=True)
    torch.save({"iteration": 5}, unhealthy / "checkpoints" / "iter_000005" / "state.pt")
    (unhealthy / "metrics.jsonl").write_text('{"iteration": 0, "time_s": 0.0}\n')
    (unhealthy / "status").write_text("stopped_unhealthy\nkl/value 9 > 10 x its running median\n")
    health = {"rule": "kl_spike", "iteration": 7, "message": "kl/value 9 > 10 x its running median", "values": {}}
    (unhealthy / "summary.json").write_text(json.dumps({"status": "stopped_unhealthy", "health": health}))
    space = {"seed": {"grid": [0]}}
    _spec(tmp / "health_value.yaml", "health_value", space, health={"kl_spike": {"factor": 0.5}})
    _spec(tmp / "health_rule.yaml", "health_rule", space, health={"entropy": {"floor": 0.1}})
    _spec(tmp / "health_base.yaml", "health_base", space, overrides={"health.kl_spike.factor": 3})
    (tmp / "site.yaml").write_text(yaml.safe_dump({"gpus_per_node": 8, "cpus_per_node": 64}))
    (tmp / "alias_site.yaml").write_text("partition: p\ntime: 1:00:00\ngpus_per_node: &g 8\ncpus_per_node: *g\n")
    (tmp / "binary.yaml").write_bytes(b"name: x\n\xf8\xff\x00\x01 not text")
    (tmp / "alias.yaml").write_text(
        "name: alias\nmetric: train/reward\nspace: {algo.anchor.tau: {grid: [1.0, 0.9]}}\n"
        "base: {experiment: math_tiny_ema_pg, overrides: {trainer.iterations: &n 2, trainer.eval_every: *n}}\n"
    )
    _spec(tmp / "inf_range.yaml", "inf_range", {"algo.kl.coef": {"uniform": [0.0, float("inf")]}}, search="random")
    _spec(tmp / "big_seed.yaml", "big_seed", {"algo.anchor.tau": {"grid": [0.9]}}, seeds=[0, 12345678901234567890])
    _spec(tmp / "long_name.yaml", "n" * 300, {"algo.anchor.tau": {"grid": [0.9]}})
    _spec(tmp / "seed_axis.yaml", "seed_axis", {"seed": {"grid": [0, 2**32]}})


def _spec(path, name: str, space: dict, overrides: dict | None = None, **top) -> None:
    base = {"experiment": "math_tiny_ema_pg", **({"overrides": overrides} if overrides else {})}
    path.write_text(yaml.safe_dump({"name": name, "metric": "eval/math_tiny/acc", "base": base, "space": space, **top}))


def test_there_are_at_least_40_cases_over_every_command():
    assert len(CASES) >= 40
    assert {c[0][0] for c in CASES} == {"train", "sweep", "report", "retriever", "cluster", "eval"}


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_clear_error(argv, words, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    monkeypatch.setenv("EMAPG_PROGRESS", "0")
    monkeypatch.chdir(tmp_path)  # nothing is written into the checkout, whatever happens
    _setup(tmp_path)
    argv = [argv[0], *(TRAIN if argv[0] == "train" else []), *(a.replace("{tmp}", str(tmp_path)) for a in argv[1:])]
    with pytest.raises(SystemExit) as exit_:  # argparse exits itself; the CLI returns its code
        raise SystemExit(main(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "Traceback" not in err and err.strip(), err
    message = err.strip().splitlines()[-1]  # argparse prints its usage first
    assert message.startswith(f"emapg {argv[0]}"), err
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert not (tmp_path / "outputs").exists()  # refused before any work


def test_emapg_debug_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.setenv("EMAPG_DEBUG", "1")
    assert main(["train", "seed=abc"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "emapg train: error: seed: 'abc' is not an integer"


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    def broken(argv):
        raise AttributeError("'NoneType' object has no attribute 'x'")

    monkeypatch.setattr("analysis.report.main_report", broken)
    assert main(["report"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_a_message_is_printed_at_most_message_chars_long(monkeypatch, capsys):
    """Whatever an error's text holds, the one error path prints a bounded line (errors.MESSAGE_CHARS)."""
    from experiments.errors import MESSAGE_CHARS

    def huge(argv):
        raise ValueError(f"value {'x' * 10**6} is not allowed")

    monkeypatch.setattr("analysis.report.main_report", huge)
    assert main(["report"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) <= MESSAGE_CHARS + 100 and "more characters" in err, err[:300]


def test_the_message_is_json_safe_for_a_bad_corpus_line(tmp_path, capsys):
    """A retriever corpus that is not JSONL names the file and line (a file the user gave)."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"contents": "a"}) + "\n{broken\n")
    code = main(["retriever", "index", "--corpus", str(corpus), "--out", str(tmp_path / "i")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "c.jsonl" in err, err
