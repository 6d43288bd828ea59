"""Preflight's parts one by one: weight headers, text that is not UTF-8, dataset folders,
the rows one step needs, upstream exports, and reward imports that hang. The command
line cases (exit 2, nothing written) are in test_cli_bad_input.py."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from core.config import load_pipeline
from core.errors import InvalidInput
from core.rows import read_rows
from pipeline import preflight, weightnames
from pipeline.executors import executor_for
from pipeline.hfcache import hf_cache
from pipeline.modelfiles import BadModelFile, check_weights, weights_in
from tests.conftest import tiny_pipeline, write_pipeline


def check(tmp_path, spec) -> None:
    """preflight.check of the pipeline file `spec`, for its own executor."""
    loaded = load_pipeline(str(write_pipeline(tmp_path, spec)))
    preflight.check(loaded, executor_for(loaded.cluster.executor))


def refusal(tmp_path, spec) -> str:
    with pytest.raises(InvalidInput) as info:
        check(tmp_path, spec)
    return info.value.message


def safetensors(path, tensors: dict, data_bytes: int):
    """A safetensors file written by hand: 8-byte little-endian header length, JSON header, data."""
    header = json.dumps(tensors).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(data_bytes))
    return path


# --------------------------------------------------------------------------- weights


def test_a_safetensors_file_whose_header_matches_its_data_passes(tmp_path):
    check_weights(safetensors(tmp_path / "w.safetensors", {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
    }, data_bytes=32))


def test_a_tensor_whose_offsets_disagree_with_its_shape_is_a_damaged_header(tmp_path):
    path = safetensors(tmp_path / "w.safetensors", {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}},
                       data_bytes=16)
    with pytest.raises(BadModelFile, match=r"tensor a \(F32 \[2, 3\]\) needs 24 bytes but its offsets give 16"):
        check_weights(path)


def test_a_header_length_beyond_the_file_is_not_safetensors(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(BadModelFile, match="header claims 10,000 bytes but the file holds 10"):
        check_weights(path)


def test_a_git_lfs_pointer_in_place_of_weights_says_so(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(BadModelFile, match="Git LFS pointer"):
        check_weights(path)


def test_a_bin_file_that_is_neither_zip_nor_pickle_is_refused(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"<html>not found</html>")
    with pytest.raises(BadModelFile, match="neither a torch.save archive nor a pickle"):
        check_weights(path)


# --------------------------------------------------------------------------- weight names


LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10, "intermediate_size": 16}


def weights_folder(folder, shapes: dict, shards: int = 1):
    """A model folder of safetensors headers (zeros for data), its tensors in `shards` files with their index."""
    folder.mkdir()
    names = list(shapes)
    files = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors": names[i::shards]
             for i in range(shards)}
    for file, held in files.items():
        header, offset = {}, 0
        for name in held:
            size = 4 * shapes[name][0] * shapes[name][1]
            header[name] = {"dtype": "F32", "shape": shapes[name], "data_offsets": [offset, offset + size]}
            offset += size
        safetensors(folder / file, header, data_bytes=offset)
    if shards > 1:
        weight_map = {name: file for file, held in files.items() for name in held}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def llama_shapes(layers=2, hidden=8, vocab=10, kv_width=4, prefix="model."):
    shapes = {f"{prefix}embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden]}
    for i in range(layers):
        shapes[f"{prefix}layers.{i}.self_attn.q_proj.weight"] = [hidden, hidden]
        shapes[f"{prefix}layers.{i}.self_attn.k_proj.weight"] = [kv_width, hidden]
    return shapes


def contradiction(folder, config=None):
    return weightnames.mismatch(config or LLAMA_CONFIG, weights_in(folder))


def test_weights_named_and_shaped_as_config_json_says_pass_whole_sharded_or_saved_as_a_base_model(tmp_path):
    assert contradiction(weights_folder(tmp_path / "whole", llama_shapes())) is None
    assert contradiction(weights_folder(tmp_path / "sharded", llama_shapes(), shards=3)) is None
    assert contradiction(weights_folder(tmp_path / "base", llama_shapes(prefix=""))) is None


def test_a_gpt2_config_over_llama_weights_names_both_families(tmp_path):
    gpt2 = {"model_type": "gpt2", "n_embd": 8, "n_layer": 2, "n_head": 2, "vocab_size": 10}
    found = contradiction(weights_folder(tmp_path / "m", llama_shapes()), gpt2)
    assert "config.json's model_type is gpt2, whose weights are named as GPT-2 models name theirs " \
           "(transformer.wte.weight" in found
    assert "but the weights are named as Llama-style models name theirs (model.embed_tokens.weight" in found
    assert "config.json belongs to another model" in found


def test_a_llama_config_over_weights_of_other_names_lists_theirs(tmp_path):
    found = contradiction(weights_folder(tmp_path / "m", {"tok_embeddings.weight": [10, 8], "output.weight": [10, 8]}))
    assert "but no weight has that name (the weights' names: output.weight, tok_embeddings.weight" in found


def test_more_or_fewer_layers_than_config_json_gives_are_refused(tmp_path):
    found = contradiction(weights_folder(tmp_path / "m", llama_shapes(layers=3)))
    assert found == ("config.json's num_hidden_layers is 2, but the weights hold 3 decoder layers "
                     "(model.layers.N.self_attn.q_proj.weight for N in 0-2)")


def test_a_hidden_size_or_kv_heads_other_than_the_weights_name_the_file_and_the_fields(tmp_path):
    wider = contradiction(weights_folder(tmp_path / "m", llama_shapes()), {**LLAMA_CONFIG, "hidden_size": 16})
    assert wider == "model.embed_tokens.weight in model.safetensors is [10, 8], but config.json's vocab_size, " \
                    "hidden_size make it [10, 16]"
    heads = contradiction(weights_folder(tmp_path / "kv", llama_shapes(kv_width=8), shards=2))
    assert heads.startswith("model.layers.0.self_attn.k_proj.weight in model-0000")
    assert "num_key_value_heads, head_dim, hidden_size make it [4, 8]" in heads


def test_an_index_that_places_a_tensor_in_a_shard_without_it_is_refused(tmp_path):
    folder = weights_folder(tmp_path / "m", llama_shapes(), shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BadModelFile, match="places tensor model.embed_tokens.weight in model-00002-of-00002"):
        weights_in(folder)


def test_nothing_is_said_where_the_rule_cannot_tell(tmp_path):
    folder = weights_folder(tmp_path / "m", llama_shapes(layers=3))
    assert contradiction(folder, {**LLAMA_CONFIG, "model_type": "stablelm"}) is None  # a family it does not know
    assert contradiction(folder, {**LLAMA_CONFIG, "quantization_config": {"bits": 4}}) is None
    torch_saved = tmp_path / "torch"
    torch_saved.mkdir()
    (torch_saved / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle: its names need torch
    assert weights_in(torch_saved) is None


# --------------------------------------------------------------------------- text and files


def test_non_utf8_bytes_in_a_csv_file_name_the_line_and_byte(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_bytes(b"prompt,response\nsort 21 =,12\nsort 3\xff1 =,13\n")
    with pytest.raises(InvalidInput, match=r"line 3: not UTF-8 text \(byte 0xff at byte 7 of the line\)"):
        read_rows(path)


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_bytes("\ufeffprompt,response\na,b\n".encode())
    assert read_rows(path) == [{"prompt": "a", "response": "b"}]


def test_a_damaged_parquet_file_is_refused_by_name(tmp_path):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1 cut short")
    with pytest.raises(InvalidInput, match="rows.parquet: not a readable Parquet file"):
        read_rows(path)


# --------------------------------------------------------------------------- dataset folders


@pytest.fixture(scope="module")
def saved_datasets(tmp_path_factory):
    """Folders as datasets' save_to_disk writes them: a DatasetDict and a single Dataset."""
    import datasets

    root = tmp_path_factory.mktemp("datasets")
    rows = [{"prompt": f"sort {n} =", "response": " x"} for n in range(20)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:3])}).save_to_disk(str(root / "dict"))
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "one"))
    return root


def folder_spec(path, **data):
    spec = tiny_pipeline()
    spec["stages"][0]["data"] = {"path": str(path), **data}
    return spec


def test_a_dataset_dict_folder_with_its_splits_passes(tmp_path, saved_datasets):
    # 20 train rows; eval from the test split: 20 >= 8 x 2 processes
    check(tmp_path, folder_spec(saved_datasets / "dict", eval_split="test"))


def test_a_split_the_dataset_folder_lacks_lists_the_ones_it_has(tmp_path, saved_datasets):
    message = refusal(tmp_path, folder_spec(saved_datasets / "dict", eval_split="validation"))
    assert "data.eval_split" in message and "has no split 'validation'; its splits: train, test" in message


def test_rows_of_a_dataset_folder_are_counted_against_one_step(tmp_path, saved_datasets):
    spec = folder_spec(saved_datasets / "dict")  # eval held out: 20 - 1 = 19 rows
    spec["defaults"]["micro_batch_size"] = 10
    message = refusal(tmp_path, spec)
    assert "19 training rows (20 usable in" in message and "20 = micro_batch_size 10 x gradient accumulation 1 x 2" \
        in message


def test_a_column_the_dataset_folder_lacks_is_named_with_the_columns_it_has(tmp_path, saved_datasets):
    spec = folder_spec(saved_datasets / "dict", response_key="answer")
    message = refusal(tmp_path, spec)
    assert "has no column 'prompt' (data.prompt_key)+'answer' (data.response_key)" in message
    assert "its columns: prompt, response" in message


def test_eval_split_of_a_dataset_without_splits_is_refused(tmp_path, saved_datasets):
    message = refusal(tmp_path, folder_spec(saved_datasets / "one", eval_split="test"))
    assert "holds one dataset without splits" in message and "would be its training rows again" in message


# --------------------------------------------------------------------------- steps and upstream stages


def test_a_rollout_needs_rollout_batch_size_prompts(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"p{n}", "label": "x"}) + "\n"
                                                    for n in range(30)))
    spec = tiny_pipeline()
    spec["stages"].append({"name": "rl", "kind": "ppo", "from": "sft",
                           "data": {"path": str(tmp_path / "prompts.jsonl"), "max_rows": 12},
                           "rollout_batch_size": 16, "micro_batch_size": 8, "reward": {"rules": [{"rule": "length"}]}})
    message = refusal(tmp_path, spec)
    # 30 rows, 1 held out (eval_fraction 0.05), cut to max_rows 12: 12 < 16
    assert "stages[1] (rl).data: 12 training rows (30 usable in" in message
    assert "less 1 held out" in message and "cut to max_rows 12" in message
    assert "rollout_batch_size 16" in message


@pytest.mark.parametrize("tied", [True, False])
def test_a_language_model_may_start_from_a_reward_model_only_when_its_head_is_the_embedding(tmp_path, tied):
    """A reward model exports a sequence classifier; a causal LM loaded from it gets its
    output layer from the embeddings when they are tied, else a new random one."""
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 48, "max_position_embeddings": 64, "tie_word_embeddings": tied}))
    spec = load_pipeline(str(write_pipeline(tmp_path, tiny_pipeline(stages=[
        {"name": "rm", "kind": "rm", "model": str(folder), "data": {"path": "builtin:digits"}},
        {"name": "sft", "kind": "sft", "from": "rm", "data": {"path": "builtin:digits"}},
    ]))))
    if tied:
        preflight.check_upstream(spec, spec.stages[1], "stages[1] (sft)", hf_cache(spec))
    else:
        with pytest.raises(InvalidInput, match="stage 'rm' trains a reward model"):
            preflight.check_upstream(spec, spec.stages[1], "stages[1] (sft)", hf_cache(spec))


def test_a_reward_model_stage_with_unmerged_adapters_cannot_score_rollouts(tmp_path):
    spec = tiny_pipeline()
    spec["stages"] = [
        {**spec["stages"][0], "name": "rm", "kind": "rm", "lora": {"merge": False}},
        {"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
         "rollout_batch_size": 16, "micro_batch_size": 8, "reward": {"model": "rm"}},
    ]
    assert "stages[1] (rl).reward.model: stage 'rm' has lora.merge: false" in refusal(tmp_path, spec)


# --------------------------------------------------------------------------- rewards


def test_a_reward_file_that_hangs_at_import_is_stopped_and_named(tmp_path):
    path = tmp_path / "slow.py"
    path.write_text("import time\ntime.sleep(600)\n\n\ndef score(prompts, completions, labels):\n    return []\n")
    problem = preflight.import_problem(f"{path}:score", timeout_s=1)
    assert problem is not None and f"importing {path} did not finish within 1 s" in problem


def test_a_reward_file_that_imports_returns_no_problem(tmp_path):
    path = tmp_path / "fine.py"
    path.write_text("import math\n\n\ndef score(prompts, completions, labels):\n"
                    "    return [math.pi] * len(completions)\n")
    assert preflight.import_problem(f"{path}:score") is None


def test_preflight_of_every_kind_of_input_imports_no_gpu_library(tmp_path, saved_datasets):
    """validate runs on login nodes: a local model folder, a data file, a dataset folder
    and a reward function are all checked without torch, transformers or deepspeed."""
    from core import tiny

    model = weights_folder(tmp_path / "model", llama_shapes(hidden=64, vocab=48, kv_width=64))
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 48, "max_position_embeddings": 64}))
    tiny.build_core_tokenizer().save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": tiny.CHAT_TEMPLATE}))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"p{n}", "response": "r", "label": "r"})
                                                 + "\n" for n in range(40)))
    (tmp_path / "mine.py").write_text("def score(prompts, completions, labels):\n    return [0.0] * len(completions)\n")
    spec = tiny_pipeline(stages=[
        {"name": "sft", "kind": "sft", "model": str(model), "data": {"path": "rows.jsonl", "chat_template": True}},
        {"name": "sft2", "kind": "sft", "from": "sft", "data": {"path": str(saved_datasets / "dict")}},
        {"name": "rl", "kind": "ppo", "from": "sft2", "data": {"path": "rows.jsonl"}, "rollout_batch_size": 16,
         "micro_batch_size": 8, "max_new_tokens": 8,
         "reward": {"rules": [{"rule": "exact_match"}, {"function": "mine.py:score"}]}},
    ])
    code = ("import sys; from core import config; from pipeline import preflight; "
            "from pipeline.executors import executor_for; "
            "spec = config.load_pipeline(sys.argv[1]); preflight.check(spec, executor_for(spec.cluster.executor)); "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed', 'datasets') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, str(write_pipeline(tmp_path, spec))], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
