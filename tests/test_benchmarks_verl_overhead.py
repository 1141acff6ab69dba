"""benchmarks/verl_overhead.py without running verl: the five variants' launches (what each changes and nothing
else), the parsing of verl's timers and of the TransferQueue records, and the section it writes. Its runs take
half an hour; these keep the script from rotting when the compiled launch, verl's keys or the records change."""

import json

import pytest

from benchmarks import verl_overhead as vo


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    from experiments.tasks import RehearsalData

    tmp = tmp_path_factory.mktemp("vo")
    data = RehearsalData(files={"train": str(tmp / "train.parquet"), "test": str(tmp / "test.parquet")}, sft=[])
    return {v.name: vo.variant_argv(v, str(tmp / "model"), data, tmp / v.name, steps=6) for v in vo.VARIANTS}


def _as_dict(argv):
    return dict(a.split("=", 1) for a in argv)


def test_the_variants_differ_only_where_they_should(launches):
    a, b, c, d, e = (_as_dict(launches[n]) for n in ("a", "b", "c", "d", "e"))
    for o in (a, b, c, d, e):  # every run: no checkpoints, no validation, the benchmark's worker hook
        assert o["trainer.save_freq"] == "-1" and o["trainer.test_freq"] == "-1"
        assert o["trainer.val_before_train"] == "false" and o[vo.HOOK_KEY] == vo.HOOK
        assert o["trainer.total_training_steps"] == "6" and o["trainer.device"] == "cpu"
    # (a) is (b) with verl's own trainer and its K3 loss
    assert a["trainer.v1.trainer_mode"] == "sync" and a["actor_rollout_ref.actor.kl_loss_type"] == "low_var_kl"
    assert b["trainer.v1.trainer_mode"] == "emapg_sync" and b["actor_rollout_ref.actor.kl_loss_type"] == "emapg"
    diff = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} - {"trainer.experiment_name"}
    assert {k for k in diff if not k.startswith(("emapg.metrics_path", "data.", "trainer.default_local_dir"))} == {
        "trainer.v1.trainer_mode",
        "actor_rollout_ref.actor.kl_loss_type",
    }
    assert a["actor_rollout_ref.actor.use_kl_loss"] == "true"  # verl builds its reference model
    assert b["emapg.mask_truncated"] == "true"
    assert b["emapg.anchor.tau"] == "1.0" and c["emapg.anchor.tau"] == "0.95" and c["emapg.anchor.period"] == "2"
    assert b["emapg.kl.type"] == c["emapg.kl.type"] == "k3"
    assert d["emapg.kl.type"] == "topk_reverse" and d["emapg.kl.k"] == "32" and d["emapg.kl.tail"] == "paper"
    assert d["emapg.kl.use_iw"] == "true" and d["emapg.anchor.tau"] == "0.95"
    assert all(o["emapg.probe_every"] == "0" for o in (a, b, c, d))
    assert e["emapg.probe_every"] == "1" and e["emapg.probe_size"] == "2"
    assert {k for k in d.keys() | e.keys() if d.get(k) != e.get(k)} == {
        "emapg.probe_every",
        "emapg.probe_size",
        "emapg.metrics_path",
        "trainer.experiment_name",
        "trainer.default_local_dir",
    }


def test_edit_argv_refuses_a_key_the_launch_lacks():
    assert vo.edit_argv(["x=1", "y=2"], {"y": "3"}) == ["x=1", "y=3"]
    with pytest.raises(ValueError, match=r"not exactly one of \['z'\]"):
        vo.edit_argv(["x=1"], {"z": "0"})
    with pytest.raises(ValueError, match="not exactly one"):
        vo.edit_argv(["x=1", "x=2"], {"x": "0"})


def test_field_sizes_count_the_packed_values():
    import torch

    ids = torch.nested.nested_tensor_from_jagged(torch.zeros(7, 32, dtype=torch.int32), torch.tensor([0, 3, 7]))
    sizes = vo.field_sizes({"emapg_old_topk_ids": ids, "uid": ["u0", "u1"], "scores": torch.zeros(2)})
    assert sizes == {
        "emapg_old_topk_ids": {"bytes": 7 * 32 * 4, "tokens": 7},
        "uid": {"bytes": None, "tokens": None},
        "scores": {"bytes": 8, "tokens": None},
    }


def _f(nbytes, tokens=None):
    return {"bytes": nbytes, "tokens": tokens}


def _write_run(run_dir, steps=3, k=32, topk=True, t0=100.0):
    """verl's metrics file and the TransferQueue records of a fake run: per step, the rollout's put, the pi_old
    pass (get, put ids), the anchor pass (get incl. the ids, put log-probs), the trainer's advantages, the update's
    fetch, 10 tokens; the worker (pid 1) spends 2 CPU seconds per step, the trainer (pid 9) 0.5."""
    run_dir.mkdir(parents=True)
    metrics, tq = [], []
    for s in range(1, steps + 1):
        data = {"timing_s/step": 1.0 + s, "timing_s/gen": 0.5, "timing_s/update_actor": 0.3, "actor/pg_loss": 0.0}
        data["perf/total_num_tokens"] = 10
        if s % 2 == 0:
            data["timing_s/emapg_ema"] = 0.1
        metrics.append({"step": s, "data": data})
        t = t0 + 10 * s
        base = {"input_ids": _f(80, 10), "old_log_probs": _f(40, 10)}
        ids = {"emapg_old_topk_ids": _f(10 * 4 * k, 10)} if topk else {}
        logp = {"emapg_ref_logp_k": _f(10 * 4 * k, 10)} if topk else {}
        w, tr = 2.0 * s, 0.5 * s  # CPU seconds of the worker and the trainer
        tq += [
            {"op": "put", "pid": 7, "t": t + 1, "s": 0.01, "fields": {"input_ids": _f(80, 10)}},  # the rollout
            {"op": "get", "pid": 1, "t": t + 2, "cpu": w - 1, "s": 0.02, "fields": {"input_ids": _f(80, 10)}},
            {"op": "put", "pid": 1, "t": t + 3, "cpu": w - 1, "s": 0.03, "fields": {"log_probs": _f(40, 10), **ids}},
            {"op": "get", "pid": 1, "t": t + 4, "cpu": w - 1, "s": 0.04, "fields": {**base, **ids}},
            {"op": "put", "pid": 1, "t": t + 5, "cpu": w - 1, "s": 0.05, "fields": {"log_probs": _f(40, 10), **logp}},
            {"op": "put", "pid": 9, "t": t + 5.5, "cpu": tr, "s": 0.5, "fields": {"advantages": _f(40, 10)}},
            {"op": "get", "pid": 9, "t": t + 6, "cpu": tr, "s": 0.5, "fields": {"advantages": _f(40, 10)}},
            {
                "op": "get",
                "pid": 1,
                "t": t + 7,
                "cpu": w,
                "s": 0.06,
                "fields": {**base, "advantages": _f(40, 10), **ids, **logp},
            },
        ]
    (run_dir / "verl_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run_dir / "tq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tq) + '{"op": "get", "pi')  # a cut line


def test_job_steps_read_verls_timers_and_the_transfer_queue_records(tmp_path):
    _write_run(tmp_path / "run")
    steps = vo.job_steps(tmp_path / "run", warmup=1)
    assert [s["step"] for s in steps] == [2, 3]
    s2, s3 = steps
    assert s2["step_s"] == 3.0 and s2["gen"] == 0.5 and s2["emapg_ema"] == 0.1 and s3["emapg_ema"] == 0.0
    assert s2["ref"] == 0.0 and s2["num_tokens"] == 10  # a timer verl did not log that step: 0
    assert s2["topk_update_bpt"] == 256 and s2["topk_put_bpt"] == 256  # K = 32: 4K ids + 4K log-probs
    assert s2["topk_moved_bpt"] == 128 + 128 + 128 + 256  # put ids, the anchor pass's get, put logp, the update
    assert s2["update_bpt"] == 8 + 4 + 4 + 256 and s2["topk_fields"] == ["emapg_old_topk_ids", "emapg_ref_logp_k"]
    assert s2["worker_cpu_s"] == 2.0 and s2["trainer_cpu_s"] == 0.5  # from one update fetch to the next
    assert vo.tq_steps(vo.read_jsonl(tmp_path / "run" / "tq.jsonl"))[1]["worker_cpu_s"] is None  # no step before


def test_the_least_disturbed_estimates():
    assert vo.fast_mean([5.0, 1.0, 3.0, 2.0, 9.0]) == 1.5  # the fastest ceil(5 / 4) = 2


def test_summary_ratios_and_the_section(tmp_path):
    import argparse

    jobs = []
    for rnd in range(2):
        for name, topk in (("a", False), ("d", True)):
            run = tmp_path / f"r{rnd}_{name}"
            _write_run(run, steps=4, topk=topk, t0=1000.0 * rnd)
            steps = vo.job_steps(run, warmup=2)
            if name == "d":
                for s in steps:
                    s["step_s"] *= 1.1
            jobs.append({"variant": name, "round": rnd, "steps": steps, "load": [1.0, 1, 1], "load_mean": 1.5 + rnd})
    summary = vo.summarise(jobs)
    assert summary["a"]["steps"] == 4 and summary["a"]["step_s"] == pytest.approx(4.5)
    assert summary["a"]["topk_update_bpt"] == 0 and summary["d"]["topk_update_bpt"] == 256
    r = vo.ratios(summary)
    assert r["d"]["ratio"] == pytest.approx(1.1) and r["d"]["rounds_fast"] == pytest.approx([1.1, 1.1])
    assert r["d"]["fast"] == pytest.approx(1.1) and r["d"]["median_fast"] == pytest.approx(1.1)
    args = argparse.Namespace(rounds=2, steps=4, warmup=2, variants=["a", "d"])
    m = {k: "x" for k in ("cpu", "cores", "ram_gib", "torch", "python", "loadavg", "date")}
    text = vo.render(jobs, args, m, wall_s=60.0, loads=[(1.0, 1.0, 1.0)])
    assert "python benchmarks/verl_overhead.py --rounds 2 --steps 4 --variants a d --write" in text
    assert "| (d) | 4 | 4.950 |" in text and "| 1.100 | 1.100 | 1.10 (1.5), 1.10 (2.5) | 1.100 | 1.000 |" in text
    assert "- (d), target 1.05x: median of the rounds 1.100x (**missed**), pooled fastest quarter 1.100x" in text
    assert "worker CPU 1.000x (met)" in text
    assert "(a): update fetch 16.0 B, no Top-k fields; (d): update fetch 272.0 B with `emapg_old_topk_ids`" in text
    assert "256.0 B of Top-k received, 256.0 B put by the passes, 640.0 B moved in all (puts + gets)." in text


@pytest.mark.parametrize("script", ["verl_overhead"])
def test_without_verl_a_verl_benchmark_says_how_to_install_it_in_one_line(script, monkeypatch, capsys):
    import importlib

    mod = importlib.import_module(f"benchmarks.{script}")

    def missing():
        raise ImportError("the verl backend needs the [verl] extra")

    monkeypatch.setattr(mod, "require_verl", missing)
    monkeypatch.setattr("sys.argv", [f"{script}.py"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2 and capsys.readouterr().err == "the verl backend needs the [verl] extra\n"
