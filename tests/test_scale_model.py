"""--scale-model: the same pipeline file on a narrow random-init copy of each model it starts from
(pipeline/scale.py, stages/scale_model.py). The Slurm suite runs the shipped 34B file this way on
two nodes (tests/test_slurm_scale_model.py); these tests check how the copy is made."""

from __future__ import annotations

import json
import shutil

import pytest

from core import tiny
from core.config import PipelineSpec, load_pipeline
from core.errors import InvalidInput
from core.shapes import BUILTIN_SHAPES, from_config_json, to_config_json
from pipeline import scale
from pipeline.hfcache import HFCache
from tests.conftest import run_cli, tiny_pipeline, write_pipeline

CODELLAMA = "codellama/CodeLlama-34b-hf"


@pytest.fixture
def no_cache(tmp_path):
    return HFCache(tmp_path / "hf", tmp_path / "hf" / "hub", tmp_path / "hf" / "datasets")


def test_a_scale_model_keeps_the_architecture_and_narrows_the_heads():
    config = scale.narrowed(to_config_json(BUILTIN_SHAPES[CODELLAMA]), 4, "here")
    # 64 heads x 4 = 256; the MLP keeps its ratio to the hidden size: 22016 x 256 / 8192 = 688.
    assert (config["hidden_size"], config["intermediate_size"]) == (256, 688)
    assert {k: config[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                                   "max_position_embeddings", "rope_theta", "tie_word_embeddings")} == {
        "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 16384, "rope_theta": 1e6, "tie_word_embeddings": False}


def test_an_explicit_head_dim_in_config_json_is_narrowed_too():
    gemma_like = {"model_type": "llama", "hidden_size": 3072, "num_attention_heads": 16, "head_dim": 256,
                  "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 24576}
    config = scale.narrowed(gemma_like, 8, "here")
    assert (config["hidden_size"], config["head_dim"], config["intermediate_size"]) == (128, 8, 1024)


def test_the_scale_pipeline_runs_apart_from_the_real_one(tmp_path, no_cache):
    spec = load_pipeline("llama34b_dpo.yaml")
    spec = spec.model_copy(update={"runs_dir": str(tmp_path / "runs")})
    scaled = scale.scaled(spec, no_cache, 8, build=False)
    assert scaled.name == "llama34b-dpo-1n8g-scale"
    folder = tmp_path / "runs" / "llama34b-dpo-1n8g-scale" / "scale-models" / "codellama--CodeLlama-34b-hf-hd8"
    assert scaled.stage("sft").model == str(folder) and not folder.exists()
    assert scaled.stage("dpo").from_ == "sft" and scaled.stage("dpo").model is None
    # Everything else is the file's.
    assert scaled.cluster == spec.cluster and scaled.container == spec.container
    for mine, theirs in zip(scaled.stages, spec.stages):
        assert mine.model_dump(exclude={"model"}) == theirs.model_dump(exclude={"model"})


@pytest.mark.parametrize("head_dim", [0, 3])
def test_an_odd_head_dim_is_refused(no_cache, head_dim):
    with pytest.raises(InvalidInput, match="even head dimension"):
        scale.scaled(load_pipeline("llama34b_dpo.yaml"), no_cache, head_dim, build=False)


def test_a_model_whose_config_is_nowhere_here_is_refused_with_what_to_fetch(no_cache):
    spec = PipelineSpec.model_validate(tiny_pipeline(stages=[{
        "name": "sft", "kind": "sft", "model": "my-org/unknown-7b", "data": {"path": "builtin:digits"}}]))
    with pytest.raises(InvalidInput) as err:
        scale.scaled(spec, no_cache, 8, build=False)
    assert "stages[0] (sft).model" in err.value.message
    assert "huggingface-cli download my-org/unknown-7b config.json" in err.value.message


def test_a_hub_model_in_the_table_gets_a_byte_level_tokenizer_and_is_written_once(tmp_path, no_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "scale"
    description = scale.describe("meta-llama/Llama-2-7b-hf", no_cache, 2, "here")
    assert description["tokenizer"] is None
    scale.write(folder, description, echo=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (32, 64, 32000)
    written = json.loads((folder / "config.json").read_text())
    assert written["rope_theta"] == 1e4  # at the top, where transformers 4.x reads it
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "Sort: ünï 42"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == model.config.bos_token_id
    assert len(ids) == 1 + len(text.encode()) and tokenizer.decode(ids[1:]) == text

    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    scale.write(folder, description, echo=lambda line: None)  # the same description: not rewritten
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    scale.write(folder, scale.describe("meta-llama/Llama-2-7b-hf", no_cache, 4, "here"), echo=lambda line: None)
    assert AutoModelForCausalLM.from_pretrained(folder).config.hidden_size == 128  # another description: rebuilt


def test_a_local_model_keeps_its_own_tokenizer_and_the_weights_are_the_same_every_time(tmp_path, no_cache):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    source = tiny.materialize("tiny-llama", tmp_path / "builtin")
    description = scale.describe(str(source), no_cache, 2, "here")
    assert description["tokenizer"] == str(source.resolve())
    for name in ("a", "b"):
        scale.write(tmp_path / name, description, echo=lambda line: None)
    assert (AutoTokenizer.from_pretrained(tmp_path / "a").get_vocab()
            == AutoTokenizer.from_pretrained(source).get_vocab())
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    shape = from_config_json(json.loads((tmp_path / "a" / "config.json").read_text()))
    # tiny-llama: 2 heads, both key-value heads, at head dimension 2
    assert (shape.layers, shape.heads, shape.kv_heads, shape.hidden) == (2, 2, 2, 4)


def test_plan_with_scale_model_plans_the_narrow_model_and_says_where_it_is(workdir):
    shutil.copy(load_pipeline.__globals__["CONFIGS_DIR"] / "llama34b_dpo_8xa100.yaml", workdir / "p.yaml")
    result = run_cli("plan", "p.yaml", "--scale-model", "--scale-head-dim", "2", "--json", cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr
    shape = json.loads(result.stdout)["stages"][0]["shape"]  # stdout stays JSON
    assert (shape["layers"], shape["heads"], shape["kv_heads"], shape["hidden"]) == (48, 64, 8, 128)
    assert shape["n_params"] == pytest.approx(16.3e6, rel=0.01)
    assert "scale model of codellama/CodeLlama-34b-hf: 16.3M params, 48 layers, 64 heads (8 KV)" in result.stderr
    assert (workdir / "runs" / "llama34b-dpo-1n8g-scale" / "scale-models").is_dir()


def test_scale_head_dim_without_scale_model_is_refused(workdir):
    config = write_pipeline(workdir, tiny_pipeline())
    result = run_cli("validate", config, "--scale-head-dim", "4", cwd=workdir, timeout=120)
    assert result.returncode == 2 and "give it with --scale-model" in result.stderr
