"""The engine's pure parts: DeepSpeed config, learning-rate schedule, LoRA merge."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import SFTStage
from stages import engine


def stage(**knobs):
    return SFTStage.model_validate(
        {"name": "s", "kind": "sft", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"}, **knobs}
    )


def test_accumulation_is_derived_from_the_global_batch_and_world_size():
    config = engine.deepspeed_config(stage(micro_batch_size=2, global_batch_size=32), 4, 64, on_gpu=False)
    assert config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 32


def test_zero3_partitions_matrices_but_keeps_vectors_whole():
    config = engine.deepspeed_config(stage(zero_stage=3), 2, hidden_size=4096, on_gpu=True)
    threshold = config["zero_optimization"]["stage3_param_persistence_threshold"]
    assert 4096 < threshold < 4096 * 4096


def test_optimizer_offload_goes_to_the_cpu_and_uses_deepspeeds_cpu_adam():
    config = engine.deepspeed_config(stage(zero_stage=2, optimizer_offload=True), 2, 64, on_gpu=False)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "torch_adam" not in config["optimizer"]["params"]


def test_precision_sections():
    assert engine.deepspeed_config(stage(precision="bf16"), 1, 64, False)["bf16"]["enabled"]
    fp32 = engine.deepspeed_config(stage(precision="fp32"), 1, 64, False)
    assert not fp32["bf16"]["enabled"] and not fp32["fp16"]["enabled"]


def test_cosine_schedule_with_warmup():
    factor = engine.learning_rate_factor(stage(warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.1), 104)
    assert factor(0) == pytest.approx(1 / 5)
    assert factor(3) == pytest.approx(4 / 5)
    assert factor(4) == pytest.approx(1.0)
    assert factor(54) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(104) == pytest.approx(0.1)


def test_linear_and_constant_schedules():
    linear = engine.learning_rate_factor(stage(lr_schedule="linear"), 10)
    assert [round(linear(s), 3) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    constant = engine.learning_rate_factor(stage(lr_schedule="constant", warmup_steps=2), 10)
    assert constant(9) == 1.0


def test_lora_merge_matches_peft_merge_and_unload(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from stages import tiny

    base_dir = tiny.materialize("tiny-llama", tmp_path)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM"),
    )
    with torch.no_grad():  # B starts at zero; give the adapters something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    merged = engine.merge_lora_state_dict(dict(model.state_dict()), scaling=8 / 4)
    reference = model.merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-5, atol=1e-6)
