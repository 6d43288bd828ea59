"""Configurations known to run, planned as they ran: the field report's LoRA reward model on six
RTX 4090s (CONTEXT.md, question 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core import kinds, shapes
from core.config import LoraSpec
from pipeline import plan

GiB = 1024**3
LLAMA3_8B = "meta-llama/Meta-Llama-3-8B"


def test_the_field_reports_lora_reward_model_on_six_4090s_fits_with_buckets_of_what_it_trains():
    """Llama-3-8B reward model, LoRA r=64 on all linear layers, ZeRO-2, max_len 4096, checkpointing,
    flash attention, micro batch 1 on 6 RTX 4090: it trained for 24 hours. Its gradient buckets hold
    the 168M adapters (and the score head), two of them with overlap_comm: 0.63 GiB, not 5e8-element
    buckets (1.86 GiB) that no gradient fills (stages/engine.py sizes them so)."""
    stage = kinds.get("rm").schema.model_validate(dict(
        name="rm", kind="rm", model=LLAMA3_8B, data={"path": "builtin:digits"}, precision="bf16", zero_stage=2,
        lora=LoraSpec(rank=64), max_len=4096, gradient_checkpointing=True, attention="flash_attention_2",
        micro_batch_size=1, global_batch_size=48))
    hw = plan.Hardware.from_cluster(SimpleNamespace(gpu="rtx4090", gpus_per_node=6, tasks_per_node=None))
    p = plan.plan_stage(stage, shapes.BUILTIN_SHAPES[LLAMA3_8B], hw, model_name=LLAMA3_8B)
    adapters = 32 * 64 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))  # peft's count
    assert p.trained_params == adapters + 4096 == 167_776_256
    buckets = next(i.bytes for i in p.memory.items if i.name.endswith("gradient buckets"))
    assert buckets == 2 * 2 * p.trained_params
    assert p.fits and p.memory.gpu_headroom > 0.5 * GiB
