"""Only the weights it was given (stages/loaded_weights.py): a stage that loads a model whose folder
does not hold exactly the model's weights stops before it trains, with exit 2, naming the folder,
the architecture and the weights; the heads a stage adds by design still load. In-process loads
(no DeepSpeed), a ZeRO-3 load in a process of its own, and `run` with 2 ZeRO-3 processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import EXIT_INVALID, InvalidInput
from core.schemas.sft import SFTStage
from stages import models
from tests.conftest import REPO, run_cli, tiny_pipeline, write_pipeline


def edited_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """Tiny model folders, each as a user might hand one over (tokenizer beside the weights)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2Config

    from core import tiny

    root = tmp_path_factory.mktemp("models")
    llama = root / "llama"
    tiny.write_tiny_llama(llama)
    tokenizer = [p for p in llama.iterdir() if "token" in p.name or "chat_template" in p.name]

    def copy(name, weights=True) -> Path:
        skipped = None if weights else shutil.ignore_patterns("*.safetensors")
        return Path(shutil.copytree(llama, root / name, ignore=skipped))

    vocab = json.loads((llama / "config.json").read_text())["vocab_size"]
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=64)
    gpt2.save_pretrained(copy("gpt2-config"))
    model = AutoModelForCausalLM.from_pretrained(llama)
    torch.save(model.state_dict(), copy("gpt2-config-torch-weights", weights=False) / "pytorch_model.bin")
    gpt2.save_pretrained(root / "gpt2-config-torch-weights")
    edited_config(copy("wider-mlp"), intermediate_size=128)
    edited_config(copy("fewer-layers"), num_hidden_layers=1)
    model.save_pretrained(root / "missing-shard", max_shard_size="100KB")
    sorted((root / "missing-shard").glob("model-*.safetensors"))[-1].unlink()
    weights = copy("truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    for name, tied in (("reward-model", False), ("tied-reward-model", True)):
        reward_model = AutoModelForSequenceClassification.from_pretrained(llama, num_labels=1, tie_word_embeddings=tied)
        reward_model.save_pretrained(root / name)
        for file in tokenizer:
            shutil.copy(file, root / name)
    headless = Path(shutil.copytree(root / "reward-model", root / "reward-model-without-score"))
    tensors = load_file(headless / "model.safetensors")
    del tensors["score.weight"]
    save_file(tensors, headless / "model.safetensors", metadata={"format": "pt"})
    return root


def spec(**knobs) -> SFTStage:
    return SFTStage.model_validate({"name": "sft", "kind": "sft", "model": "builtin:tiny-llama",
                                    "data": {"path": "builtin:digits"}, "precision": "fp32", "max_len": 32, **knobs})


def load_causal_lm(folder: Path, **knobs):
    return models.load_causal_lm(str(folder), spec(**knobs), {}, on_gpu=False)


def load_reward_model(folder: Path, **knobs):
    return models.load_reward_model(str(folder), spec(**knobs), {}, on_gpu=False, pad_token_id=0)


def refusal(load, folder: Path) -> str:
    with pytest.raises(InvalidInput) as refused:
        load(folder)
    assert refused.value.exit_code == EXIT_INVALID
    return refused.value.message


# --------------------------------------------------------------------------- refused


# GPT-2 has no sdpa attention on transformers 4.38: these loads ask for eager.
GPT2_REFUSED = "its weights are not the ones its config.json describes ("


def named_as_gpt2_weights(message: str) -> bool:
    """The refusal names the weights (transformers 5), or says none is a base-model weight (4.x refuses
    such a folder before it compares names)."""
    return ("weights of the model are not in the folder (transformer.h.0.attn.c_attn.bias" in message
            and "weights of the folder have no place in the model (model.embed_tokens.weight" in message
            and " more)" in message) or "the folder holds none of the weights of the model's base" in message


def test_a_gpt2_config_over_llama_weights_is_refused_naming_folder_architecture_and_weights(folders):
    message = refusal(lambda folder: load_causal_lm(folder, attention="eager"), folders / "gpt2-config")
    assert f"model {folders / 'gpt2-config'}: {GPT2_REFUSED}" in message and "model_type gpt2)" in message
    assert named_as_gpt2_weights(message), message
    assert "Check that config.json was saved with these weights" in message


def test_a_weight_of_another_shape_is_refused_with_both_shapes(folders):
    message = refusal(load_causal_lm, folders / "wider-mlp")
    assert ("6 weights have another shape in the folder (model.layers.0.mlp.down_proj.weight: [64, 176] in the "
            "folder, [64, 128] in the model") in message


def test_weights_of_layers_the_config_does_not_have_are_refused(folders):
    assert "9 weights of the folder have no place in the model (model.layers.1." in refusal(
        load_causal_lm, folders / "fewer-layers")


def test_a_shard_missing_from_its_index_is_refused_with_what_to_do(folders):
    message = refusal(load_causal_lm, folders / "missing-shard")
    assert "safetensors" in message and "a file of the model is missing" in message
    assert "download or save the model again" in message


def test_a_truncated_weights_file_is_refused_not_a_traceback(folders):
    message = refusal(load_causal_lm, folders / "truncated")
    assert "a safetensors file would not read" in message and "cut short or damaged" in message


def test_a_reward_model_from_a_reward_model_must_bring_its_score_head(folders):
    message = refusal(load_reward_model, folders / "reward-model-without-score")
    assert "(LlamaForSequenceClassification; model_type llama): 1 weight of the model is not in the folder " \
           "(score.weight)" in message


def test_a_language_model_from_an_untied_reward_model_has_no_trained_head(folders):
    assert "1 weight of the model is not in the folder (lm_head.weight)" in refusal(
        load_causal_lm, folders / "reward-model")


# --------------------------------------------------------------------------- the heads a stage adds


def test_a_reward_model_or_critic_from_a_language_model_gets_its_new_score_head(folders):
    assert type(load_reward_model(folders / "llama")).__name__ == "LlamaForSequenceClassification"


def test_a_reward_model_from_a_reward_model_loads_its_own_head(folders):
    assert type(load_reward_model(folders / "reward-model")).__name__ == "LlamaForSequenceClassification"


def test_a_language_model_from_a_tied_reward_model_leaves_its_score_head_behind(folders):
    assert type(load_causal_lm(folders / "tied-reward-model")).__name__ == "LlamaForCausalLM"


def test_lora_adapters_are_added_to_checked_models(folders):
    lora = {"lora": {"rank": 4, "alpha": 8}}
    assert hasattr(load_causal_lm(folders / "llama", **lora), "peft_config")
    assert hasattr(load_reward_model(folders / "llama", **lora), "peft_config")


# --------------------------------------------------------------------------- ZeRO-3


def test_zero3_loads_refuse_what_plain_loads_refuse(folders, tmp_path):
    """transformers 5 under ZeRO-3 counts no weight without a place in the model: compat counts them."""
    for name in ("llama", "fewer-layers", "gpt2-config", "reward-model-without-score"):
        (tmp_path / name).symlink_to(folders / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "compat_probe.py"), "weights", str(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert found["llama"] == {"causal_lm": "LlamaForCausalLM", "reward_model": "LlamaForSequenceClassification"}
    assert "9 weights of the folder have no place in the model (model.layers.1." in found["fewer-layers"]["causal_lm"]
    assert GPT2_REFUSED in found["gpt2-config"]["causal_lm"]
    assert named_as_gpt2_weights(found["gpt2-config"]["causal_lm"])
    assert "(score.weight)" in found["reward-model-without-score"]["reward_model"]


def test_run_stops_a_stage_whose_weights_validate_cannot_read_with_exit_2(folders, workdir):
    """torch.save weights: validate cannot read their names, the stage's 2 ZeRO-3 processes refuse them."""
    stages = tiny_pipeline(defaults={"zero_stage": 3, "attention": "eager"})
    stages["stages"][0]["model"] = str(folders / "gpt2-config-torch-weights")
    config = write_pipeline(workdir, stages)
    assert run_cli("validate", config, cwd=workdir).returncode == 0
    result = run_cli("run", config, cwd=workdir)
    assert result.returncode == EXIT_INVALID, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"stage sft: model {folders / 'gpt2-config-torch-weights'}: {GPT2_REFUSED}" in result.stderr
    assert named_as_gpt2_weights(result.stderr) and "Traceback" not in result.stderr
    status = run_cli("status", config, cwd=workdir).stdout
    assert "failed" in status and GPT2_REFUSED in status
