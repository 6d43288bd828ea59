"""Bad input: exit 2, a short message naming what is wrong, no traceback, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages.distributed import free_port
from tests.conftest import REPO, run_cli, tiny_pipeline, write_pipeline


def assert_rejected(result, *fragments, workdir=None):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    if workdir is not None:
        assert not (workdir / "runs").exists(), "a rejected pipeline must write nothing"


def run_rejected(workdir, spec_or_text, *fragments):
    path = workdir / "pipeline.yaml"
    if isinstance(spec_or_text, str):
        path.write_text(spec_or_text)
    else:
        write_pipeline(workdir, spec_or_text)
    for command in ("validate", "run"):
        assert_rejected(run_cli(command, path, cwd=workdir), *fragments, workdir=workdir)


def sft_spec(**data):
    spec = tiny_pipeline()
    spec["stages"][0]["data"] = {"path": "builtin:digits", **data}
    return spec


def test_malformed_yaml(workdir):
    run_rejected(workdir, "name: t\nstages: [\n", "malformed YAML at line 3")


def test_unknown_key_with_suggestion(workdir):
    spec = tiny_pipeline(defaults={"micro_batch": 2})
    run_rejected(workdir, spec, "unknown key 'micro_batch'", "did you mean 'micro_batch_size'")


def test_value_out_of_range(workdir):
    spec = tiny_pipeline()
    spec["stages"][0]["learning_rate"] = -1
    run_rejected(workdir, spec, "stages[0] (sft).learning_rate", "greater than 0")


def test_missing_data_file(workdir):
    run_rejected(workdir, sft_spec(path="nowhere/rows.jsonl"), "data file nowhere/rows.jsonl not found")


def test_rows_without_the_configured_keys_name_the_row(workdir):
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}, {"prompt": "e", "answer": "f"}]
    (workdir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_rejected(workdir, sft_spec(path="rows.jsonl"), "row 3", "missing column 'response'", "data.response_key")


def test_row_that_is_not_json_names_the_line(workdir):
    (workdir / "rows.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    run_rejected(workdir, sft_spec(path="rows.jsonl"), "line 2: not valid JSON")


def test_missing_model_folder(workdir):
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = "./models/not-here"
    run_rejected(workdir, spec, "stages[0] (sft).model", "does not exist")


def test_unloadable_model_folder(workdir):
    folder = workdir / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text("{ not json")
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = str(folder)
    run_rejected(workdir, spec, "config.json is not readable JSON")


def test_model_folder_without_weights(workdir):
    folder = workdir / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = str(folder)
    run_rejected(workdir, spec, "no weights")


def test_unknown_pipeline_name_lists_the_shipped_ones(workdir):
    assert_rejected(run_cli("validate", "no-such-pipeline", cwd=workdir), "no such pipeline file", "tiny")


def test_validate_accepts_the_tiny_pipeline_and_writes_nothing(workdir):
    result = run_cli("validate", "tiny", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "valid pipeline 'tiny'" in result.stdout and "warning" not in result.stderr
    assert not (workdir / "runs").exists()


def preference_rows(path: Path, count: int, start: int = 0) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{n}:", "chosen": f"{n}", "rejected": f"{n}."}) + "\n"
                            for n in range(start, start + count)))
    return path


def rm_spec(**data) -> dict:
    spec = tiny_pipeline()
    spec["stages"] = [{"name": "rm", "kind": "rm", "model": "builtin:tiny-llama", "data": data, "max_steps": 5}]
    return spec


def test_validate_warns_of_evaluation_rows_that_are_training_rows(workdir):
    train = preference_rows(workdir / "train.jsonl", 40)
    evaluation = preference_rows(workdir / "eval.jsonl", 40, start=3)  # rows 3..39 are training rows
    result = run_cli("validate", write_pipeline(workdir, rm_spec(path=str(train), eval_split=str(evaluation))),
                     cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert ("warning: stages[0] (rm).data: eval rows 37 of 40 also appear in the training rows: the eval metrics "
            "measure memory, not generalisation") in result.stderr


def test_validate_warns_when_rows_held_out_for_evaluation_have_copies_left_for_training(workdir):
    rows = workdir / "rows.jsonl"
    rows.write_text(preference_rows(workdir / "once.jsonl", 50).read_text() * 2)  # every row twice
    result = run_cli("validate", write_pipeline(workdir, rm_spec(path=str(rows), eval_fraction=0.1)), cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "warning: stages[0] (rm).data: eval rows " in result.stderr
    assert "of 10 also appear in the training rows" in result.stderr


@pytest.mark.stack_free  # preflight's GPU check asks torch only, the same torch on both stacks
def test_gpus_asked_of_a_machine_that_shows_none_are_refused_before_anything_runs(workdir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # none visible, whatever this machine has
    path = write_pipeline(workdir, tiny_pipeline(cluster={"gpus_per_node": 2}))
    for command in ("validate", "run"):
        result = run_cli(command, path, cwd=workdir)
        assert_rejected(result, "cluster.gpus_per_node: 2 GPUs asked", "set gpus_per_node: 0", workdir=workdir)
        # What was found: a CPU-only torch, or a CUDA torch with every device hidden.
        assert "has no CUDA support" in result.stderr or "no CUDA device visible (CUDA_VISIBLE_DEVICES='')" \
            in result.stderr, result.stderr


def test_validate_of_a_slurm_pipeline_does_not_look_for_its_gpus_here(workdir):
    path = write_pipeline(workdir, tiny_pipeline(cluster={"executor": "slurm", "gpus_per_node": 8}))
    result = run_cli("validate", path, cwd=workdir)
    assert result.returncode == 0, result.stderr


def test_the_pipeline_package_imports_no_gpu_libraries():
    code = (
        "import sys, pipeline.cli, pipeline.launch, pipeline.graph, pipeline.preflight, stages.runner;"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_missing_reward_function_is_reported_at_validate_time(workdir):
    spec = tiny_pipeline()
    spec["stages"].append({
        "name": "rl", "kind": "ppo", "from": "sft", "data": {"path": "builtin:digits"},
        "advantage": "grpo", "n_samples_per_prompt": 2, "rollout_batch_size": 8, "micro_batch_size": 8,
        "reward": {"rules": [{"function": "rewards/mine.py:score"}]},
    })
    run_rejected(workdir, spec, "stages[1] (rl).reward.rules[0].function", "rewards/mine.py not found")


# --------------------------------------------------------------------------- refused before anything trains
# Each of these passed `validate` once and failed only in the stage, after upstream
# stages had spent their compute (issue 12).


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory):
    """The built-in tiny Llama as save_pretrained writes it: whole (safetensors), and as
    safetensors shards with their index; and its weights as torch.save wrote them before
    safetensors (pytorch_model.bin, what transformers 4.x saves without safe_serialization)."""
    import torch
    from transformers import AutoModelForCausalLM

    from core import tiny

    root = tmp_path_factory.mktemp("models")
    tiny.write_tiny_llama(root / "whole")
    model = AutoModelForCausalLM.from_pretrained(root / "whole")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    tiny.build_tokenizer().save_pretrained(root / "sharded")
    shutil.copytree(root / "whole", root / "torch", ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(model.state_dict(), root / "torch" / "pytorch_model.bin")
    return root


@pytest.fixture
def model_folder(saved_models, workdir):
    """A copy of one saved model in the working folder, to break as a test needs."""

    def copy(kind="whole"):
        return Path(shutil.copytree(saved_models / kind, workdir / "model"))

    return copy


def with_model(folder, **stage):
    spec = tiny_pipeline()
    spec["stages"][0].update(model=str(folder), **stage)
    return spec


def write_rows(workdir, rows, name="rows.jsonl"):
    (workdir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return name


SFT_ROWS = [{"prompt": f"sort {n} =", "response": f" {''.join(sorted(str(n)))}"} for n in range(100, 140)]


def test_a_saved_model_folder_and_a_data_file_are_accepted(model_folder, workdir):
    folder = model_folder()
    path = write_pipeline(workdir, with_model(folder, data={"path": write_rows(workdir, SFT_ROWS)}))
    result = run_cli("validate", path, cwd=workdir)
    assert result.returncode == 0, result.stderr


def test_truncated_safetensors_weights_are_refused_by_their_header(model_folder, workdir):
    weights = model_folder() / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    run_rejected(workdir, with_model(weights.parent), "stages[0] (sft).model", "model.safetensors: tensor",
                 "cut short", "download or save the model again")


def test_a_shard_named_by_the_index_that_is_missing_is_refused(model_folder, workdir):
    folder = model_folder("sharded")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    run_rejected(workdir, with_model(folder), "model.safetensors.index.json names", "1 of them missing",
                 shards[-1].name)


def test_a_gpt2_config_over_llama_weights_is_refused_before_anything_trains(model_folder, workdir):
    folder = model_folder()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
        "vocab_size": 48, "n_positions": 64}))
    run_rejected(workdir, with_model(folder), "stages[0] (sft).model", f"{folder / 'config.json'}: config.json's "
                 "model_type is gpt2", "named as Llama-style models name theirs (model.embed_tokens.weight",
                 "put the config.json saved with these weights beside them")


def test_a_truncated_torch_save_file_is_refused(model_folder, workdir):
    weights = model_folder("torch") / "pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[:-200])
    run_rejected(workdir, with_model(weights.parent), "pytorch_model.bin: a torch.save archive whose end is missing")


def test_a_model_folder_without_a_tokenizer_is_refused(model_folder, workdir):
    folder = model_folder()
    (folder / "tokenizer.json").unlink()
    run_rejected(workdir, with_model(folder), "stages[0] (sft).model", "has no tokenizer", "tokenizer.json",
                 "save_pretrained")


def test_chat_template_with_a_tokenizer_that_has_none_is_refused(model_folder, workdir):
    folder = model_folder()
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    spec = with_model(folder, data={"path": write_rows(workdir, SFT_ROWS), "chat_template": True})
    run_rejected(workdir, spec, "stages[0] (sft).data.chat_template", "has no chat template",
                 "data.chat_template: false")
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]}
             for r in SFT_ROWS]
    spec = with_model(folder, data={"path": write_rows(workdir, chats)})
    run_rejected(workdir, spec, "stages[0] (sft).data.messages_key", "has no chat template")


def test_max_len_beyond_the_model_positions_is_refused(workdir):
    spec = tiny_pipeline(defaults={"max_len": 96})  # builtin:tiny-llama has 64 positions
    run_rejected(workdir, spec, "stages[0] (sft).max_len",
                 "96 tokens is beyond the 64 positions of model builtin:tiny-llama",
                 "Set max_len to 64 or less")


def test_a_hub_model_missing_from_the_cache_without_network_points_at_prepare(workdir, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(workdir / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = "some-org/some-model"
    run_rejected(workdir, spec,
                 "stages[0] (sft).model: model 'some-org/some-model' is not a folder here, nor in the local cache",
                 "HF_HUB_OFFLINE=1", "python -m pipeline prepare")
    # `prepare` itself is not refused for it: it is what fetches it (here, offline, it cannot).
    result = run_cli("prepare", workdir / "pipeline.yaml", cwd=workdir)
    assert_rejected(result, "cannot fetch model 'some-org/some-model'")


def test_a_hub_that_does_not_answer_counts_as_offline(workdir, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(workdir / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    spec = tiny_pipeline()
    spec["stages"][0]["data"] = {"path": "some-org/some-rows"}
    run_rejected(workdir, spec,
                 "stages[0] (sft).data.path: dataset 'some-org/some-rows' is not a folder here, nor in the local cache",
                 f"{endpoint} cannot be reached")


def test_a_data_file_of_an_unsupported_type_names_the_supported_ones(workdir):
    (workdir / "rows.txt").write_text("sort 21 = 12\n")
    run_rejected(workdir, sft_spec(path="rows.txt"), "stages[0] (sft).data.path: rows.txt", "a .txt file",
                 "a .jsonl, .json, .csv or .parquet file")


def test_a_folder_that_is_not_a_dataset_is_refused(workdir):
    (workdir / "notes").mkdir()
    (workdir / "notes" / "readme.md").write_text("rows are elsewhere")
    run_rejected(workdir, sft_spec(path="notes"), "stages[0] (sft).data.path: notes: a folder that holds no dataset",
                 "found: readme.md", "dataset_dict.json")


def test_fewer_rows_than_one_optimizer_step_are_refused_with_the_numbers(workdir):
    # 10 usable rows, 1 held out (eval_fraction 0.05, at least one): 9 < 8 rows x 2 processes
    run_rejected(workdir, sft_spec(path=write_rows(workdir, SFT_ROWS[:10])),
                 "stages[0] (sft).data: 9 training rows (10 usable in rows.jsonl, less 1 held out for evaluation",
                 "16 = micro_batch_size 8 x gradient accumulation 1 x 2 processes")


def test_a_split_name_as_eval_split_of_a_data_file_is_refused(workdir):
    run_rejected(workdir, sft_spec(path=write_rows(workdir, SFT_ROWS), eval_split="test"),
                 "stages[0] (sft).data.eval_split: 'test' is a split name", "eval_split names a second file")


def test_non_utf8_bytes_in_a_jsonl_file_name_the_line(workdir):
    lines = [json.dumps(r).encode() for r in SFT_ROWS]
    lines[2] = lines[2].replace(b"sort", b"s\xe9rt")  # latin-1, not UTF-8
    (workdir / "rows.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    run_rejected(workdir, sft_spec(path="rows.jsonl"),
                 "stages[0] (sft).data.path: rows.jsonl: line 3: not UTF-8 text (byte 0xe9", "save the file as UTF-8")


def test_a_duplicate_key_in_the_pipeline_file_names_both_lines(workdir):
    text = yaml.safe_dump(tiny_pipeline(), sort_keys=False).replace("  max_len: 48\n", "  max_len: 48\n  max_len: 32\n")
    line = text.splitlines().index("  max_len: 48") + 1
    run_rejected(workdir, text, f"key 'max_len' is given twice in one mapping, at line {line}, column 3 and "
                 f"line {line + 1}, column 3")


def rl_stage(**stage):
    return {"name": "rl", "kind": "ppo", "from": "sft", "data": {"path": "builtin:digits"},
            "advantage": "grpo", "n_samples_per_prompt": 2, "rollout_batch_size": 8, "micro_batch_size": 8,
            "reward": {"rules": [{"rule": "exact_match"}]}, **stage}


def test_a_stage_starting_from_an_unmerged_lora_adapter_is_refused(workdir):
    spec = tiny_pipeline(defaults={"lora": {"rank": 4, "merge": False}})
    spec["stages"].append({"name": "dpo", "kind": "dpo", "from": "sft", "data": {"path": "builtin:digits"}})
    run_rejected(workdir, spec, "stages[1] (dpo).from: stage 'sft' has lora.merge: false",
                 "Set lora.merge: true in stage 'sft'")


def test_a_language_model_stage_starting_from_a_reward_model_is_refused(workdir):
    spec = tiny_pipeline()
    spec["stages"] = [{**spec["stages"][0], "name": "rm", "kind": "rm"}, rl_stage(**{"from": "rm"})]
    run_rejected(workdir, spec, "stages[1] (rl).from: stage 'rm' trains a reward model", "reward.model")


def test_exact_match_without_a_label_column_is_refused(workdir):
    prompts = write_rows(workdir, [{"prompt": r["prompt"]} for r in SFT_ROWS], "prompts.jsonl")
    spec = tiny_pipeline()
    spec["stages"].append(rl_stage(data={"path": prompts}))
    run_rejected(workdir, spec, "stages[1] (rl).label_key: prompts.jsonl: usable row 1 has no 'label' column",
                 "exact_match rule")


def test_a_reward_file_whose_import_fails_names_the_file_line_and_error(workdir):
    (workdir / "rewards").mkdir()
    (workdir / "rewards" / "mine.py").write_text(
        "import os\nimport a_module_that_is_not_installed\n\n\ndef score(prompts, completions, labels):\n"
        "    return [0.0] * len(completions)\n")
    spec = tiny_pipeline()
    spec["stages"].append(rl_stage(reward={"rules": [{"function": "rewards/mine.py:score"}]}))
    run_rejected(workdir, spec, "stages[1] (rl).reward.rules[0].function: importing rewards/mine.py fails (line 2)",
                 "ModuleNotFoundError: No module named 'a_module_that_is_not_installed'")


def test_a_runs_dir_that_is_a_file_is_refused(workdir):
    (workdir / "results").write_text("not a folder")
    run_rejected(workdir, tiny_pipeline(runs_dir="results"), "runs_dir:", "results is a file")


def test_a_runs_dir_that_cannot_be_written_is_refused(workdir):
    (workdir / "shared").mkdir(mode=0o555)
    path = write_pipeline(workdir, tiny_pipeline(runs_dir="shared/runs"))
    # Root writes anywhere; in a user namespace of its own it is held to the owner's bits, as users are.
    as_user = ["unshare", "--user"] if os.geteuid() == 0 else []
    if as_user and subprocess.run([*as_user, "true"]).returncode != 0:
        pytest.skip("running as root, and user namespaces are not allowed here")
    for command in ("validate", "run"):
        result = subprocess.run([*as_user, sys.executable, "-m", "pipeline", command, str(path)], cwd=workdir,
                                capture_output=True, text=True, timeout=120)
        assert_rejected(result, "runs_dir:", "shared is not writable by this user")
        assert not (workdir / "shared" / "runs").exists()


def test_a_runs_dir_that_cannot_be_created_is_refused_not_a_traceback_from_run(workdir):
    # /proc takes no folders, even from root, who passes every permission bit.
    run_rejected(workdir, tiny_pipeline(runs_dir="/proc/nope"),
                 "runs_dir: the run folder /proc/nope/t cannot be created in /proc: /proc takes no new folders",
                 "set runs_dir (now '/proc/nope') to a folder you can write")


def test_a_runs_dir_on_a_read_only_file_system_is_refused(workdir):
    shared = workdir / "shared"
    shared.mkdir()
    path = write_pipeline(workdir, tiny_pipeline(runs_dir="shared/runs"))
    mount = f"mount -t tmpfs tmpfs {shared} && mount -o remount,ro {shared}"
    for command in ("validate", "run"):
        result = subprocess.run(["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh",
                                 sys.executable, "-m", "pipeline", command, str(path)],
                                cwd=workdir, capture_output=True, text=True, timeout=120)
        if "mount" in result.stderr and result.returncode != 2:
            pytest.skip(f"cannot mount a file system in a private mount namespace here: {result.stderr.strip()}")
        assert_rejected(result, f"runs_dir: the run folder {shared / 'runs' / 't'} cannot be created in {shared}: "
                        f"the file system holding {shared} is mounted read-only")


def test_a_max_len_that_cuts_too_many_rows_of_a_later_stage_is_refused_before_the_first_stage(workdir):
    # The dpo stage starts from sft, whose tokenizer is the built-in one: one token per
    # character and <s>. Short pairs take 6 tokens; the 3 long ones 24, with a 21-token prompt.
    rows = [{"prompt": "ab", "chosen": "cd", "rejected": "ce"}] * 17
    rows += [{"prompt": "sort 1234567890123 =", "chosen": "cd", "rejected": "ce"}] * 3
    (workdir / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tiny_pipeline()
    spec["stages"].append({"name": "dpo", "kind": "dpo", "from": "sft", "data": {"path": "pairs.jsonl"},
                           "max_len": 12})
    run_rejected(workdir, spec, "stages[1] (dpo): max_len 12 cuts 3 of 20 rows (15.0%), "
                 "more than max_truncated_share (0.1) allows", "Raise max_len to 24 or more")
