"""The pipeline file schema: what is accepted, and what each mistake says."""

from __future__ import annotations

import pytest

from core.config import CONFIGS_DIR, load_pipeline
from core.errors import InvalidInput
from schedulers.slurm import time_to_minutes
from tests.conftest import run_cli, tiny_pipeline, write_pipeline


def load(tmp_path, spec: dict):
    return load_pipeline(str(write_pipeline(tmp_path, spec)))


def error_of(tmp_path, spec) -> str:
    with pytest.raises(InvalidInput) as info:
        load(tmp_path, spec)
    return info.value.message


@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_pipeline_file_validates(path):
    spec = load_pipeline(str(path))
    assert spec.stages


def test_shipped_file_found_by_name_with_or_without_suffix():
    assert load_pipeline("tiny").name == "tiny"
    assert load_pipeline("tiny.yaml").name == "tiny"


def test_every_shipped_file_starts_with_the_command_that_runs_it():
    for path in CONFIGS_DIR.glob("*.yaml"):
        assert path.read_text().startswith("# make pipeline"), path


def test_defaults_are_merged_into_stages_and_a_stage_value_wins(tmp_path):
    spec = tiny_pipeline()
    spec["stages"][0]["learning_rate"] = 1e-4
    stage = load(tmp_path, spec).stages[0]
    assert stage.learning_rate == 1e-4
    assert stage.micro_batch_size == 8  # from defaults
    assert stage.precision == "fp32"


def test_unknown_key_is_an_error_that_suggests_the_nearest_name(tmp_path):
    spec = tiny_pipeline()
    spec["stages"][0]["lerning_rate"] = 1e-4
    message = error_of(tmp_path, spec)
    assert "stages[0] (sft)" in message
    assert "unknown key 'lerning_rate'" in message
    assert "did you mean 'learning_rate'" in message


def test_unknown_key_in_defaults_and_nested_sections(tmp_path):
    spec = tiny_pipeline(defaults={"zero_stag": 3})
    assert "did you mean 'zero_stage'" in error_of(tmp_path, spec)
    spec = tiny_pipeline()
    spec["stages"][0]["data"]["promt_key"] = "q"
    message = error_of(tmp_path, spec)
    assert "stages[0] (sft).data" in message and "did you mean 'prompt_key'" in message


def test_out_of_range_value_names_the_field_path_and_quotes_its_documentation(tmp_path):
    spec = tiny_pipeline()
    spec["stages"][0]["zero_stage"] = 4
    message = error_of(tmp_path, spec)
    assert "stages[0] (sft).zero_stage" in message
    assert "less than or equal to 3" in message
    assert "DeepSpeed ZeRO stage" in message  # the field's own documentation


def test_wrong_type_names_the_field(tmp_path):
    spec = tiny_pipeline(cluster={"gpus_per_node": "eight"})
    message = error_of(tmp_path, spec)
    assert "cluster.gpus_per_node" in message and "'eight'" in message


def test_malformed_yaml_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nstages:\n  - name: sft\n   kind: sft\n")
    with pytest.raises(InvalidInput) as info:
        load_pipeline(str(path))
    assert "malformed YAML at line 4, column" in info.value.message


def test_a_key_given_twice_in_a_nested_mapping_names_both_places(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("name: t\nstages:\n  - {name: sft, kind: sft, model: 'builtin:tiny-llama',\n"
                    "     data: {path: 'builtin:digits', split: train, split: eval}}\n")
    with pytest.raises(InvalidInput) as info:
        load_pipeline(str(path))
    assert "key 'split' is given twice in one mapping, at line 4, column 37 and line 4, column 51" in info.value.message


def test_yaml_merge_keys_override_without_counting_as_duplicates(tmp_path):
    path = tmp_path / "merged.yaml"
    path.write_text(
        "name: t\nstages:\n"
        "  - &sft {name: sft, kind: sft, model: 'builtin:tiny-llama', data: {path: 'builtin:digits'}, max_len: 32}\n"
        "  - <<: *sft\n    name: sft2\n")
    spec = load_pipeline(str(path))
    assert [s.name for s in spec.stages] == ["sft", "sft2"] and spec.stages[1].max_len == 32


def test_upstream_stage_must_exist(tmp_path):
    spec = tiny_pipeline()
    spec["stages"].append({"name": "sft2", "kind": "sft", "from": "stf", "data": {"path": "builtin:digits"}})
    message = error_of(tmp_path, spec)
    assert "no stage named 'stf'" in message and "did you mean 'sft'" in message


def test_stages_that_start_from_each_other_in_a_cycle_are_rejected_naming_them(tmp_path):
    data = {"path": "builtin:digits"}
    spec = tiny_pipeline(stages=[
        {"name": "x", "kind": "sft", "model": "builtin:tiny-llama", "data": data},
        {"name": "y", "kind": "sft", "from": "x", "data": data},
        {"name": "a", "kind": "sft", "from": "c", "data": data},
        {"name": "b", "kind": "sft", "from": "a", "data": data},
        {"name": "c", "kind": "sft", "from": "b", "data": data},
    ])
    assert "form a cycle: a -> c -> b -> a (each starts from the next)" in error_of(tmp_path, spec)


def test_an_empty_model_is_refused_showing_the_value(tmp_path):
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = ""
    result = run_cli("validate", write_pipeline(tmp_path, spec), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert 'stages[0] (sft).model: is empty (""): give a model folder' in result.stderr


def test_a_stage_needs_exactly_one_starting_point(tmp_path):
    spec = tiny_pipeline()
    del spec["stages"][0]["model"]
    assert "exactly one of `model`" in error_of(tmp_path, spec)


def test_duplicate_stage_names_are_rejected(tmp_path):
    spec = tiny_pipeline()
    spec["stages"].append(dict(spec["stages"][0]))
    assert "used twice" in error_of(tmp_path, spec)


def test_global_batch_must_divide_into_micro_batches_times_processes(tmp_path):
    spec = tiny_pipeline()
    spec["stages"][0]["global_batch_size"] = 20  # micro 8 x 2 processes = 16
    message = error_of(tmp_path, spec)
    assert "stages[0] (sft).global_batch_size" in message and "8 x 2" in message


def test_unknown_builtin_is_rejected_with_the_known_ones(tmp_path):
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = "builtin:huge-llama"
    assert "builtin:tiny-llama" in error_of(tmp_path, spec)


def test_unknown_stage_kind_lists_the_kinds(tmp_path):
    spec = tiny_pipeline()
    spec["stages"][0]["kind"] = "sfx"
    assert "'sft'" in error_of(tmp_path, spec)


@pytest.mark.parametrize("text,minutes", [
    ("90", 90), ("4:00:00", 240), ("2-00:00:00", 2880), ("1-12", 2160), ("10:30", 11), ("1-2:30", 1590),
])
def test_slurm_time_formats(text, minutes):
    assert time_to_minutes(text) == minutes


def test_bad_slurm_time_is_rejected(tmp_path):
    spec = tiny_pipeline(cluster={"time": "two hours"})
    assert "cluster.time" in error_of(tmp_path, spec)
