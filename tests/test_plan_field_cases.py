"""Configurations known to run, planned as they ran: the field report's LoRA reward model on six
RTX 4090s (CONTEXT.md, question 1)."""

from __future__ import annotations

from dataclasses import replace
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


# --------------------------------------------------------------------------- ALST's published lengths

LLAMA31_8B = "meta-llama/Llama-3.1-8B"
# ALST (arXiv 2506.13996): Llama-3.1-8B on one node of 8 H100 80GB, ZeRO-3 with the optimizer offloaded
# to the CPU, checkpointed, flash attention, one sequence a GPU (or a group). Their recipes' lengths, and
# the settings of this project that do the same: the loss over tiles of logits (logits_tile), Ulysses over
# the 8 GPUs (sequence_parallel), the tiled MLP (mlp_tiles: tiles of about `hidden` positions, as ALST's
# TiledMLP picks them), the checkpointed layer inputs in host memory (checkpoint_offload). Read as the
# paper's wording has it: offloading alone on top of the tiled loss and Ulysses, and all of them together.
ALST = {
    "tiled logits": (dict(), 160_000),
    "+ Ulysses 8": (dict(sequence_parallel=8), 1_100_000),
    "+ tiled MLP": (dict(sequence_parallel=8, mlp_tiles=True), 1_200_000),
    "+ checkpoints offloaded": (dict(sequence_parallel=8, checkpoint_offload=True), 2_400_000),
    "all": (dict(sequence_parallel=8, mlp_tiles=True, checkpoint_offload=True), 3_700_000),
}


def alst_longest(settings: dict, step: int = 8192) -> int:
    """The longest max_len (a multiple of `step`) the plan says fits with ALST's settings `settings`."""
    from pipeline.plan.estimate import estimate_stage
    from pipeline.plan.fixes import mlp_tiles_for

    shape = shapes.BUILTIN_SHAPES[LLAMA31_8B]
    hw = plan.Hardware.from_cluster(SimpleNamespace(gpu="h100-80gb", gpus_per_node=8, tasks_per_node=None))
    share = settings.get("sequence_parallel", 1)

    def fits(max_len: int) -> bool:
        knobs = plan.Knobs(kind="sft", precision="bf16", zero_stage=3, optimizer_offload=True,
                           gradient_checkpointing=True, attention="flash_attention_2", micro_batch_size=1,
                           global_batch_size=8 // share, max_len=max_len, logits_tile=1024, sequence_parallel=share,
                           checkpoint_offload=settings.get("checkpoint_offload", False))
        if settings.get("mlp_tiles"):
            knobs = replace(knobs, mlp_tiles=mlp_tiles_for(knobs, shape))
        return bool(estimate_stage(knobs, shape, hw).fits)

    low, high = step, 2 ** 24
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@pytest.mark.parametrize("row", ALST)
def test_the_longest_sequence_the_plan_fits_is_alsts_published_one_within_a_quarter(row):
    settings, published = ALST[row]
    assert 0.8 <= alst_longest(settings) / published <= 1.25


def test_checkpoint_offload_moves_the_layer_inputs_to_pinned_host_memory_and_times_their_copies():
    shape = shapes.BUILTIN_SHAPES[LLAMA31_8B]
    hw = plan.Hardware.from_cluster(SimpleNamespace(gpu="h100-80gb", gpus_per_node=8, tasks_per_node=None))
    stage = kinds.get("sft").schema.model_validate(dict(
        name="sft", kind="sft", model=LLAMA31_8B, data={"path": "builtin:digits"}, zero_stage=3,
        optimizer_offload=True, gradient_checkpointing=True, attention="flash_attention_2", max_len=262144,
        micro_batch_size=1, global_batch_size=1, sequence_parallel=8, logits_tile=1024))
    plain = plan.plan_stage(stage, shape, hw)
    offloaded = plan.plan_stage(stage.model_copy(update={"checkpoint_offload": True}), shape, hw)
    tokens = 262144 // 8  # each process's share of the sequence
    inputs = 32 * tokens * 4096 * 2  # every layer's input, bf16
    host = [i for i in offloaded.memory.items if "checkpointed layer inputs (pinned host memory" in i.name]
    assert len(host) == 1 and host[0].where == "host" and host[0].bytes == inputs
    assert offloaded.memory.host_peak - plain.memory.host_peak == 8 * inputs  # 8 processes on the node

    def device(p):
        return next(i.bytes for i in p.memory.items if i.name.startswith("policy activations (checkpointed")
                    and i.phase == "policy backward through the loss")

    assert device(plain) - device(offloaded) == inputs * 30 / 32  # two inputs stay in flight
    # down in the forward and up for the recompute, over PCIe (55.2 GB/s, the H100's measured copy)
    extra = offloaded.time.work["host_copies_s"] - plain.time.work["host_copies_s"]
    assert extra == pytest.approx(2 * inputs / 55.2e9, rel=0.01)
    assert offloaded.time.step_s > plain.time.step_s
