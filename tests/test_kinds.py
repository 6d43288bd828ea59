"""Stage kinds come from one registry (core/kinds.py): a kind declared in one file (tests/toy_kind.py,
named under the pipeline file's `plugins:`) is validated, planned and run with no other file
knowing its name; an RL kind in one file (tests/rl_kind.py) with field names of its own is planned,
validated, loads its data and trains through its declaration."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from core import kinds, tiny
from core.config import load_pipeline
from core.errors import InvalidInput
from pipeline import plan, preflight
from pipeline.executors import executor_for
from tests.conftest import plugins_importable, run_cli, tiny_pipeline, write_pipeline


@pytest.fixture
def plugin_path():
    """tests/ importable here and in the stage jobs (a plug-in must be, like any pickled code);
    the toy kind forgotten afterwards, so no other test sees it."""
    with plugins_importable():
        yield
    kinds.unregister("echo")
    sys.modules.pop("tests.toy_kind", None)


def echo_pipeline(workdir):
    stage = {"name": "echo", "kind": "echo", "model": "builtin:tiny-llama", "note": "hello",
             "data": {"path": "builtin:digits", "eval_split": "eval", "max_rows": 64}}
    spec = tiny_pipeline(cluster={"tasks_per_node": 1}, stages=[stage], plugins=["tests.toy_kind"])
    return write_pipeline(workdir, spec)


@pytest.mark.slow
@pytest.mark.stack_free
def test_a_kind_declared_in_one_file_is_validated_planned_and_run(workdir, plugin_path):
    config = echo_pipeline(workdir)
    planned = run_cli("plan", config, cwd=workdir)
    assert planned.returncode == 0, planned.stderr
    assert "echo" in planned.stdout

    (plan_of_echo,) = plan.plan_pipeline(load_pipeline(str(config)))
    names = [item.name for item in plan_of_echo.memory.items]
    assert any(n.startswith("policy weights") for n in names), names  # it trains a language model...
    assert not any("reference" in n for n in names), names  # ...and keeps no frozen copy

    done = run_cli("run", config, cwd=workdir)
    assert done.returncode == 0, done.stderr
    folder = workdir / "runs" / "t" / "echo"
    result = json.loads((folder / "result.json").read_text())
    # max_rows of the train split, and the whole eval split: no digits row loses its answer at max_len 48.
    assert result["rows_tokenised"] == 64 + tiny.DIGITS_SPLITS["eval"]
    assert (result["kind"], result["note"]) == ("echo", "hello")
    builtin = workdir / "runs" / "t" / "builtin" / "tiny-llama"
    assert json.loads((folder / "model" / "config.json").read_text()) == json.loads(
        (builtin / "config.json").read_text())


def test_a_plugin_that_cannot_be_imported_is_named(workdir):
    spec = tiny_pipeline(plugins=["no_such_module_here"])
    with pytest.raises(InvalidInput, match=r"plugins\[0\]: cannot import 'no_such_module_here'"):
        load_pipeline(str(write_pipeline(workdir, spec)))


def test_a_kind_nobody_declared_is_named_with_the_kinds_there_are(workdir):
    spec = tiny_pipeline()
    spec["stages"][0]["kind"] = "rmm"
    with pytest.raises(InvalidInput) as refused:
        load_pipeline(str(write_pipeline(workdir, spec)))
    message = str(refused.value)
    assert "stages[0] (sft): kind: no stage kind 'rmm' (did you mean 'rm'?); kinds: sft, rm, dpo, ppo" in message
    assert "{" not in message  # the stage is named, not dumped


def test_every_kind_is_declared_once_with_its_schema():
    for kind in kinds.all_kinds():
        assert kind.schema.model_fields["kind"].annotation.__args__ == (kind.name,)


def test_a_shipped_kind_is_found_from_its_declaration_as_a_plugin_is():
    from stages import runner, sft

    assert runner.run_of(kinds.get("sft")) is sft.run
    runner = (Path(__file__).parent.parent / "stages" / "runner.py").read_text()
    assert not re.search(r"from stages import .*\b(sft|rm|dpo|ppo)\b|import stages\.(sft|rm|dpo|ppo)", runner)


def test_a_plugin_declaring_a_taken_kind_name_is_refused_naming_both_sources():
    class SFTStage(kinds.get("sft").schema):  # the shipped schema's very class name, from elsewhere
        pass

    with pytest.raises(ValueError) as refused:
        kinds.register(kinds.StageKind("sft", SFTStage, rows="completion", headline="final_eval_loss"))
    assert str(refused.value) == (
        f"stage kind 'sft' is already declared by core.schemas.sft.SFTStage; {SFTStage.__module__}."
        "test_a_plugin_declaring_a_taken_kind_name_is_refused_naming_both_sources.<locals>.SFTStage cannot "
        "declare it too (give its kind another name)")
    assert kinds.get("sft").schema.__module__ == "core.schemas.sft"  # the shipped kind stands


# --------------------------------------------------------------------------- a second supervised kind


@pytest.fixture
def simpo_plugin():
    with plugins_importable():
        yield
    kinds.unregister("simpo")
    sys.modules.pop("tests.simpo_kind", None)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.stack_free
def test_a_supervised_kind_in_one_file_learns_to_prefer_the_chosen_answers(workdir, simpo_plugin):
    stage = {"name": "simpo", "kind": "simpo", "model": "builtin:tiny-llama", "max_steps": 30,
             "learning_rate": 1.0e-3, "data": {"path": "builtin:digits", "eval_split": "eval", "max_rows": 256}}
    config = write_pipeline(workdir, tiny_pipeline(cluster={"tasks_per_node": 1}, stages=[stage],
                                                   plugins=["tests.simpo_kind"]))
    done = run_cli("run", config, cwd=workdir)
    assert done.returncode == 0, done.stderr
    result = json.loads((workdir / "runs" / "t" / "simpo" / "result.json").read_text())
    assert result["kind"] == "simpo" and result["steps"] == 30
    assert result["train_pairs"] == 256 and result["eval_pairs"] == tiny.DIGITS_SPLITS["eval"]
    assert result["eval_loss"] < result["initial_eval_loss"] - 0.1
    assert result["eval_reward_accuracy"] >= result["initial_eval_reward_accuracy"] + 0.2


# --------------------------------------------------------------------------- a second RL kind

# The same RL stage in the words of tests/rl_kind.py's `reinforce` and of the shipped ppo (no KL term).
REINFORCE = {"kind": "reinforce", "prompts_per_rollout": 8, "completions_per_prompt": 2, "completion_tokens": 4,
             "sampling_batch": 16, "passes_per_rollout": 1, "estimator": "rloo", "held_out_prompts": 8,
             "score": {"rules": [{"rule": "exact_match"}]}}
AS_PPO = {"kind": "ppo", "rollout_batch_size": 8, "n_samples_per_prompt": 2, "max_new_tokens": 4,
          "micro_rollout_batch_size": 16, "ppo_epochs": 1, "advantage": "rloo", "eval_prompts": 8, "kl_coef": 0,
          "reward": {"rules": [{"rule": "exact_match"}]}}


@pytest.fixture
def rl_plugin():
    with plugins_importable():
        yield
    kinds.unregister("reinforce")
    sys.modules.pop("tests.rl_kind", None)


def rl_pipeline(workdir, *stages: dict, data=None, **cluster) -> Path:
    common = {"model": "builtin:tiny-llama", "data": data or {"path": "builtin:digits", "max_rows": 64},
              "max_steps": 2}
    spec = tiny_pipeline(stages=[{"name": stage["kind"], **common, **stage} for stage in stages],
                         plugins=["tests.rl_kind"])
    spec["cluster"].update(cluster)
    return write_pipeline(workdir, spec)


def test_a_second_rl_kind_is_planned_from_its_own_fields_as_ppo_is(workdir, rl_plugin):
    critic_and_reward_model = {"estimator": "gae", "score": {"model": "rm", "rules": [{"rule": "exact_match"}]}}
    ppo_too = {"advantage": "gae", "reward": {"model": "rm", "rules": [{"rule": "exact_match"}]}}
    rm = {"kind": "rm", "data": {"path": "builtin:digits"}}
    config = rl_pipeline(workdir, rm, {**REINFORCE, **critic_and_reward_model}, {**AS_PPO, **ppo_too},
                         gpu="a100-80gb", gpus_per_node=2)
    spec = load_pipeline(str(config))
    assert spec.stage("reinforce").upstream == ["rm"]  # its reward model, named under its own field
    _, reinforce, ppo = plan.plan_to_json(plan.plan_pipeline(spec))["stages"]
    names = [item["name"] for item in reinforce["items"]]
    assert any(n.startswith("critic") for n in names) and any(n.startswith("reward model") for n in names), names
    assert not any("reference" in n for n in names), names  # it keeps no frozen reference (ppo: kl_coef 0)
    for entry in (reinforce, ppo):  # what names the kind, and where a reference would wait (neither has one)
        del entry["stage"], entry["kind"], entry["settings"]["kind"], entry["settings"]["reference"]
    assert reinforce == ppo


def test_a_second_rl_kinds_layout_and_data_are_refused_in_its_own_field_names(workdir, rl_plugin):
    uneven = rl_pipeline(workdir, {**REINFORCE, "prompts_per_rollout": 3})
    with pytest.raises(InvalidInput, match=r"stages\[0\] \(reinforce\)\.prompts_per_rollout: 3 prompts do not "
                                           r"split evenly over 2 processes"):
        load_pipeline(str(uneven))

    rows = workdir / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{n} + {n} ="}) + "\n" for n in range(6)))
    data = {"path": str(rows), "eval_fraction": 0.5}
    few = load_pipeline(str(rl_pipeline(workdir, REINFORCE, data=data)))
    with pytest.raises(InvalidInput, match=r"3 training rows .* are fewer than one rollout takes: "
                                           r"prompts_per_rollout 8. Give more rows, or lower prompts_per_rollout"):
        preflight.check(few, executor_for("local"))

    unlabelled = load_pipeline(str(rl_pipeline(workdir, {**REINFORCE, "prompts_per_rollout": 2, "micro_batch_size": 2},
                                               data=data)))
    with pytest.raises(InvalidInput, match=r"stages\[0\] \(reinforce\)\.answer_column: .* has no 'label' column"):
        preflight.check(unlabelled, executor_for("local"))


@pytest.mark.slow
@pytest.mark.stack_free
@pytest.mark.e2e  # two RL stages run whole: the plan and validate above are in `make test`
def test_a_second_rl_kind_loads_its_data_and_trains_as_ppo_does(workdir, rl_plugin):
    done = run_cli("run", rl_pipeline(workdir, REINFORCE, AS_PPO), cwd=workdir)
    assert done.returncode == 0, done.stderr
    folders = {kind: workdir / "runs" / "t" / kind for kind in ("reinforce", "ppo")}
    results = {kind: json.loads((folder / "result.json").read_text()) for kind, folder in folders.items()}
    figures = ("initial_reward", "final_reward", "steps", "rollouts", "train_prompts", "eval_prompts", "truncation")
    assert results["reinforce"]["kind"] == "reinforce" and results["reinforce"]["rollouts"] == 2
    assert {k: results["reinforce"][k] for k in figures} == {k: results["ppo"][k] for k in figures}
    records = {kind: map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
               for kind, folder in folders.items()}
    losses = {kind: [(r["rollout"], r["reward"], r["policy_loss"]) for r in lines if "policy_loss" in r]
              for kind, lines in records.items()}
    assert losses["reinforce"] == losses["ppo"] and len(losses["ppo"]) == 2
