"""Stage kinds come from one registry (core/kinds.py): a kind declared in one file (tests/toy_kind.py,
named under the pipeline file's `plugins:`) is validated, planned and run with no other file
knowing its name."""

from __future__ import annotations

import json
import sys

import pytest

from core import kinds, tiny
from core.config import load_pipeline
from core.errors import InvalidInput
from pipeline import plan
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
    with pytest.raises(ValueError, match="declared twice"):
        kinds.register(kinds.StageKind("sft", kinds.get("rm").schema, rows="completion", headline="x"))
