"""A stage is skipped only when its spec and everything it reads are unchanged; what
changed is said; --rerun re-runs on request; superseded outputs are listed and cleaned.
No training: finished stages are written the way a stage finishes (spec.json, result.json)."""

from __future__ import annotations

import json
import os

from core import config as config_module
from core import measured
from pipeline import graph
from pipeline.executors.base import write_spec
from pipeline.identity import SAMPLE, Digests, file_digest
from tests.conftest import run_cli, tiny_pipeline, write_pipeline


def chain(workdir) -> dict:
    (workdir / "sft.jsonl").write_text('{"prompt": "1 2", "response": "3"}\n' * 20)
    (workdir / "reward.py").write_text("def score(prompts, completions, labels):\n    return [1.0] * len(prompts)\n")
    return tiny_pipeline(stages=[
        {"name": "sft", "kind": "sft", "model": "builtin:tiny-llama", "data": {"path": "sft.jsonl"}},
        {"name": "dpo", "kind": "dpo", "from": "sft", "data": {"path": "builtin:digits"}},
        {"name": "rl", "kind": "ppo", "from": "sft", "data": {"path": "builtin:digits"}, "advantage": "grpo",
         "n_samples_per_prompt": 4, "reward": {"rules": [{"function": "reward.py:score"}]}},
    ])


def finish_all(spec) -> None:
    for task in graph.build_tasks(spec):
        write_spec(task)
        task.folder.result.write_text(json.dumps({"spec_hash": task.spec_hash}))


def decisions(spec, **kwargs) -> dict:
    return {p.task.name: (p.action, p.reason) for p in graph.plan_actions(graph.build_tasks(spec), **kwargs)}


def test_a_changed_input_reruns_its_stage_and_what_starts_from_it_saying_why(workdir):
    config = write_pipeline(workdir, chain(workdir))
    spec = config_module.load_pipeline(str(config))
    finish_all(spec)
    assert {name: action for name, (action, _) in decisions(spec).items()} == {
        "sft": "skip", "dpo": "skip", "rl": "skip"}

    os.utime(workdir / "sft.jsonl", ns=(1, 1))  # touched, same content: still the same input
    assert all(action == "skip" for action, _ in decisions(spec).values())

    (workdir / "reward.py").write_text("def score(prompts, completions, labels):\n    return [0.0] * len(prompts)\n")
    plan = decisions(spec, dry_run=True)
    assert plan["sft"][0] == plan["dpo"][0] == "skip"
    assert plan["rl"] == ("run", f"reward.rules[0].function ({workdir / 'reward.py'}) changed")

    (workdir / "sft.jsonl").write_text('{"prompt": "1 2", "response": "4"}\n' * 20)
    plan = decisions(spec)  # moves the stale folders aside
    assert plan["sft"] == ("run", f"data.path ({workdir / 'sft.jsonl'}) changed")
    assert plan["dpo"] == plan["rl"] == ("run", "upstream sft starts over")
    assert sorted(p.name.split(".")[0] for p in (workdir / "runs" / "t").glob("*.superseded-*")) == ["dpo", "rl", "sft"]


def submitted_not_started(folder) -> None:
    """What submitit leaves in logs/ for a Slurm job that never started (cancelled while pending)."""
    folder.logs.mkdir(parents=True)
    (folder.logs / "4242_submitted.pkl").write_bytes(b"pickle")
    (folder.logs / "4242_submission.sh").write_text("#!/bin/bash\n")
    (folder.logs / ".submission_file_0f3a.sh").symlink_to(folder.logs / "4242_submission.sh")


def test_only_a_folder_with_outputs_is_superseded_a_never_started_one_is_reused(workdir):
    """An sft interrupted before dpo and rl started: run wrote their plan.json (and, as Slurm
    does on submitting them, rl's spec.json and the jobs' submission files in logs/); sft's
    data then changes."""
    config = write_pipeline(workdir, chain(workdir))
    spec = config_module.load_pipeline(str(config))
    tasks = {t.name: t for t in graph.build_tasks(spec)}
    write_spec(tasks["sft"])
    tasks["sft"].folder.metrics.write_text('{"step": 1, "loss": 2.0}\n')  # trained a little
    measured.save_plans(graph.plan_actions(list(tasks.values())), {"stages": [{"stage": n} for n in tasks]})
    write_spec(tasks["rl"])
    submitted_not_started(tasks["rl"].folder)

    (workdir / "sft.jsonl").write_text('{"prompt": "1 2", "response": "4"}\n' * 20)
    states = lambda: [s["state"] for s in json.loads(run_cli("status", config, "--json", cwd=workdir).stdout)["stages"]]  # noqa: E731
    assert states() == ["not finished", "not started", "not started"]  # rl: an earlier spec, never started
    plan = {p.task.name: p for p in graph.plan_actions(graph.build_tasks(spec))}
    assert plan["sft"].moved_aside and plan["sft"].reason.startswith("data.path")
    assert [(plan[n].action, plan[n].moved_aside) for n in ("dpo", "rl")] == [("run", None), ("run", None)]
    run_dir = workdir / "runs" / "t"
    assert [p.name.split(".")[0] for p in run_dir.glob("*.superseded-*")] == ["sft"]
    assert sorted(p.name for p in (run_dir / "rl").iterdir()) == ["logs", "plan.json"]  # the stale spec.json is gone
    status = json.loads(run_cli("status", config, "--json", cwd=workdir).stdout)
    assert [s["state"] for s in status["stages"]] == ["not started"] * 3, status
    assert [s["path"].split("/")[-1].split(".")[0] for s in status["superseded"]] == ["sft"]


def test_a_folder_whose_job_started_is_superseded_even_with_nothing_but_its_log(workdir):
    config = write_pipeline(workdir, chain(workdir))
    spec = config_module.load_pipeline(str(config))
    tasks = {t.name: t for t in graph.build_tasks(spec)}
    write_spec(tasks["sft"])
    submitted_not_started(tasks["sft"].folder)
    assert not tasks["sft"].folder.holds_outputs()
    (tasks["sft"].folder.logs / "4242_0_log.err").write_text("ImportError: ...\n")  # it started, and failed
    assert tasks["sft"].folder.holds_outputs()
    (workdir / "sft.jsonl").write_text('{"prompt": "1 2", "response": "4"}\n' * 20)
    plan = {p.task.name: p for p in graph.plan_actions(graph.build_tasks(spec))}
    assert plan["sft"].moved_aside is not None
    assert (workdir / plan["sft"].moved_aside / "logs" / "4242_0_log.err").exists()


def test_rerun_asks_for_a_stage_and_what_starts_from_it(workdir):
    config = write_pipeline(workdir, chain(workdir))
    spec = config_module.load_pipeline(str(config))
    finish_all(spec)
    plan = decisions(spec, dry_run=True, rerun=frozenset({"sft"}))
    assert plan == {"sft": ("run", "asked for (--rerun)"), "dpo": ("run", "upstream sft starts over"),
                    "rl": ("run", "upstream sft starts over")}
    assert {n: a for n, (a, _) in decisions(spec, dry_run=True, rerun=frozenset({"dpo"})).items()} == {
        "sft": "skip", "dpo": "run", "rl": "skip"}
    result = run_cli("run", config, "--rerun", "sfft", cwd=workdir)
    assert result.returncode == 2 and "--rerun sfft: no such stage" in result.stderr


def test_status_lists_superseded_outputs_and_clean_removes_only_them(workdir):
    config = write_pipeline(workdir, chain(workdir))
    spec = config_module.load_pipeline(str(config))
    finish_all(spec)
    decisions(spec, rerun=frozenset({"dpo"}))  # dpo's folder moved aside
    status = json.loads(run_cli("status", config, "--json", cwd=workdir).stdout)
    (aside,) = status["superseded"]
    assert aside["path"].startswith(str(workdir / "runs" / "t" / "dpo.superseded-")) and aside["bytes"] > 0
    result = run_cli("clean", config, cwd=workdir)
    assert result.returncode == 0 and "removed" in result.stdout
    assert sorted(p.name for p in (workdir / "runs" / "t").iterdir() if p.is_dir()) == ["rl", "sft"]


def test_a_large_file_is_fingerprinted_by_samples_and_digests_are_remembered(tmp_path, monkeypatch):
    monkeypatch.setattr("pipeline.identity.SAMPLED_ABOVE", 3 * SAMPLE)
    big = tmp_path / "weights.bin"
    big.write_bytes(b"a" * (4 * SAMPLE))
    first = file_digest(big, big.stat().st_size)
    with open(big, "r+b") as f:  # a byte inside the middle sample changes the fingerprint
        f.seek(2 * SAMPLE)
        f.write(b"b")
    assert file_digest(big, big.stat().st_size) != first
    digests = Digests(tmp_path / "runs")
    digest = digests.of(big)
    digests.save()
    assert Digests(tmp_path / "runs").known[str(big)]["sha256"] == digest
