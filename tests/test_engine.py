"""The engine's pure parts: DeepSpeed config, learning-rate schedule, LoRA merge."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from core.schemas.sft import SFTStage
from stages import engine, export
from tests.conftest import REPO


def stage(**knobs):
    return SFTStage.model_validate(
        {"name": "s", "kind": "sft", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"}, **knobs}
    )


def test_accumulation_is_derived_from_the_global_batch_and_world_size():
    config = engine.deepspeed_config(stage(micro_batch_size=2, global_batch_size=32), 4, 64, on_gpu=False)
    assert config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 32


def test_fewer_rows_than_one_step_after_tokenising_are_refused_naming_the_file_and_the_fix():
    from core.errors import InvalidInput

    sft = stage(micro_batch_size=4, global_batch_size=16)
    assert engine.step_counts(33, 16, sft) == (2, 2)  # the ragged tail is left out
    with pytest.raises(InvalidInput) as err:
        engine.step_counts(15, 16, sft)
    assert "builtin:digits: 15 training rows are left after tokenising" in err.value.message
    assert "fewer than one optimizer step needs (16" in err.value.message and "raise max_len" in err.value.message


def test_zero3_partitions_matrices_but_keeps_vectors_whole():
    config = engine.deepspeed_config(stage(zero_stage=3), 2, hidden_size=4096, on_gpu=True)
    threshold = config["zero_optimization"]["stage3_param_persistence_threshold"]
    assert 4096 < threshold < 4096 * 4096


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu"])
def test_optimizer_offload_goes_to_the_cpu_and_uses_deepspeeds_cpu_adam(on_gpu):
    config = engine.deepspeed_config(stage(zero_stage=2, optimizer_offload=True), 2, 64, on_gpu=on_gpu)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "torch_adam" not in config["optimizer"]["params"]
    assert "fused" not in config["optimizer"]["params"]


def test_a_gpu_run_without_offload_steps_with_torchs_fused_adamw_and_builds_no_op():
    params = engine.deepspeed_config(stage(zero_stage=2), 8, 4096, on_gpu=True)["optimizer"]["params"]
    assert params["torch_adam"] is True  # not DeepSpeed's FusedAdam, which nvcc would compile
    assert params["fused"] is True


def test_a_cpu_run_without_offload_steps_with_torchs_plain_adamw():
    params = engine.deepspeed_config(stage(zero_stage=2), 2, 64, on_gpu=False)["optimizer"]["params"]
    assert params["torch_adam"] is True
    assert "fused" not in params


@pytest.mark.slow
def test_deepspeed_hands_the_gpu_optimizer_settings_to_torch_adamw():
    # Real DeepSpeed, one process on the CPU (torch's fused AdamW runs there too): the GPU
    # config's optimizer section becomes torch.optim.AdamW(fused=True), and it steps.
    code = """
import json, torch, deepspeed
from stages import compat, distributed, engine
from tests.test_engine import stage
distributed.detect()  # a world of one, on a free port
config = engine.deepspeed_config(stage(zero_stage=0, precision="fp32"), 1, 8, on_gpu=True)
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(8, 8)
ds, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
before = model.weight.detach().clone()
ds.backward(ds(torch.randn(4, 8)).square().mean())
ds.step()
print("RESULT", json.dumps({"optimizer": type(ds.optimizer).__qualname__, "fused": ds.optimizer.defaults["fused"],
                            "stepped": not torch.equal(before, model.weight.detach())}))
compat.remove_cpu_comm_buffer()  # its /dev/shm buffer (70 MB), which DeepSpeed leaves behind
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT "):]) == {"optimizer": "AdamW", "fused": True, "stepped": True}


@pytest.mark.slow
def test_engines_built_from_one_config_all_step_with_torchs_adamw():
    # PPO builds its actor and its critic from one DeepSpeed config: both must get the optimizer it
    # names (DeepSpeed 0.13 pops torch_adam from a config it is given; the second got FusedAdam).
    code = """
import json, torch, deepspeed
from tests.test_engine import stage
from stages import compat, distributed, engine
distributed.detect()  # a world of one, on a free port
spec = stage(zero_stage=2, precision="fp32")
config = engine.deepspeed_config(spec, 1, 8, on_gpu=False)
deepspeed.init_distributed(dist_backend="gloo")
built = []
for _ in ("actor", "critic"):
    ds = engine.initialize(torch.nn.Linear(8, 8), spec, config, total_steps=10)
    inner = getattr(ds.optimizer, "optimizer", ds.optimizer)
    built.append(type(inner).__module__ + "." + type(inner).__qualname__)
print("RESULT", json.dumps({"optimizers": built, "torch_adam": config["optimizer"]["params"].get("torch_adam")}))
compat.remove_cpu_comm_buffer()  # its /dev/shm buffer (70 MB), which DeepSpeed leaves behind
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT "):]) == {"optimizers": ["torch.optim.adamw.AdamW"] * 2, "torch_adam": True}


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

    from core import tiny

    base_dir = tiny.materialize("tiny-llama", tmp_path)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM"),
    )
    with torch.no_grad():  # B starts at zero; give the adapters something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    merged = export.merge_lora_state_dict(dict(model.state_dict()), scaling=8 / 4)
    reference = model.merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-5, atol=1e-6)
