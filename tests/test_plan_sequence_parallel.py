"""The planner with sequence_parallel N (Ulysses: N processes share each micro batch):
rows over processes / N, each process 1/N of the positions, activations and logits,
attention's all-to-alls timed, the heads rule checked, and N offered as a fix.

Planning only (pure Python, milliseconds a plan): no GPU, no training. Expected numbers are
worked by hand from the shapes (Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads of 128).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from core import shapes
from core.config import PipelineSpec, load_pipeline
from core.errors import InvalidInput
from core.sequence_parallel import shares_for
from pipeline import plan
from pipeline.plan.planner import hardware_of, plan_stage
from pipeline.plan.timing import exchange_bytes

LLAMA3_8B = "meta-llama/Meta-Llama-3-8B"
CODELLAMA_34B = "codellama/CodeLlama-34b-hf"
GiB = 1024**3


def shipped(config: str, stage: str, **changes):
    """A shipped pipeline's stage (its defaults merged) with `changes`, planned on the file's own cluster."""
    spec = load_pipeline(config)
    spec_stage = spec.stage(stage).model_copy(update=changes)
    model = spec_stage.model or spec.stages[0].model
    return plan_stage(spec_stage, shapes.resolve_shape(model), hardware_of(spec), model_name=model)


def seeds_rm(**changes):
    """The seeds' case: Llama-3-8B reward model, LoRA r=64, ZeRO-3, checkpointing, flash attention,
    max_len 8192, 6 RTX 4090 (pipeline/configs/llama3_8b_rm_8k_6x4090.yaml: sequence_parallel 2)."""
    return shipped("llama3_8b_rm_8k_6x4090", "rm", **changes)


def activations(p) -> float:
    """GPU bytes of the trained model's activations at the backward through the layers."""
    return sum(i.bytes for i in p.memory.items if i.category == "activations" and "through the layers" in i.phase)


def logits(p) -> float:
    return sum(i.bytes for i in p.memory.items if i.category == "logits")


# --------------------------------------------------------------------------- the seeds' 8B RM at 8192 on 6 x 4090


def test_only_two_processes_can_share_the_8b_on_six_gpus():
    shape = shapes.resolve_shape(LLAMA3_8B)
    assert shares_for(shape.heads, shape.kv_heads, 6) == [1, 2]  # 3 and 6 split neither 32 heads nor 8 KV heads


def test_seeds_rm_at_8192_shared_by_two_fits_with_half_the_activations_and_costs_time():
    shared, alone = seeds_rm(), seeds_rm(sequence_parallel=1)
    assert shared.knobs.sequence_parallel == 2 and shared.data_parallel == 3 and shared.knobs.max_len == 8192
    assert shared.fits and alone.fits  # the plan has the unshared run fit too: 14.9 GiB of 23.6
    assert shared.memory.gpu_peak < alone.memory.gpu_peak - 4 * GiB  # 10.5 GiB
    assert activations(shared) / activations(alone) == pytest.approx(0.5, rel=0.01)
    # 48 pairs a step over 3 groups instead of 6 processes: twice the micro batches each, half the tokens each
    assert shared.estimate.batches.micro_batches_per_step == 2 * alone.estimate.batches.micro_batches_per_step == 16
    t, t1 = shared.time, alone.time
    assert t.tokens_per_step == t1.tokens_per_step == 48 * 2 * 8192
    assert t1.sequence_exchange_s == 0 < t.sequence_exchange_s <= t.exposed_communication_s
    # all-to-alls: 16 micro batches x 32 layers x 8192 positions x (2 x 4096 + 2 x 1024) x 2 B x 1/2, forward,
    # recompute and backward, over the 4090's 10 GB/s PCIe
    assert t.sequence_exchange_s == pytest.approx(16 * 32 * 8192 * 10240 * 2 / 2 * 3 / 10e9, rel=1e-6)  # 12.9 s
    assert t1.step_s < t.step_s < 1.3 * t1.step_s  # ~128 s against ~109 s a step
    assert any("not overlapped" in w for w in shared.warnings)
    text = plan.format_plan([shared])
    assert "6 processes (sequence_parallel 2: 3 data-parallel groups of 2 sharing each sequence)" in text
    assert "sequence_parallel: 1 (every process a sequence of its own)" in text  # what sharing buys


def test_seeds_faster_zero2_at_8192_fits_only_shared():
    p = seeds_rm(sequence_parallel=1, zero_stage=2)
    assert p.fits is False  # the whole bf16 base (14.3 GiB) on every card + 16,384 tokens a pair
    shared = seeds_rm(zero_stage=2)
    # half the activations, and gradient buckets of the adapters (0.63 GiB): fits (21.3 of 23.6 GiB), 10%
    # faster than ZeRO-3
    assert shared.fits and shared.memory.gpu_headroom < 3 * GiB
    assert shared.time.step_s < 0.95 * seeds_rm().time.step_s
    # cheapest first: the layer inputs on the host (21.6 GiB), ZeRO-3 (14.9), ..., the share (21.3)
    assert [s.changes for s in p.suggestions[:2]] == [{"checkpoint_offload": True}, {"zero_stage": 3}]
    assert all(s.estimate.fits for s in p.suggestions)
    assert {"sequence_parallel": 2} in [s.changes for s in p.suggestions]


def test_seeds_rm_at_16384_fits_with_its_mlps_tiled_or_shared_by_two():
    p = seeds_rm(sequence_parallel=1, max_len=16384)
    assert p.fits is False
    shared = [s for s in p.suggestions if s.changes == {"sequence_parallel": 2}]
    assert shared and shared[0].estimate.fits and not shared[0].changes_training
    assert "max_len stays 16384" in shared[0].description
    # cheaper per row: twice the GPUs (22.4 GiB), the optimizer on the host (23.5), the layer inputs on the
    # host (15.7), 8 tiles of 4,096 positions (19.3), then the share (14.9)
    assert [s.changes for s in p.suggestions[1:4]] == [{"optimizer_offload": True}, {"checkpoint_offload": True},
                                                       {"mlp_tiles": 8}]
    assert p.suggestions[0].changes["nodes"] == 2 and p.suggestions[4] is shared[0]


# ---------------------------------------------------------------------- 34B at 32k on the shipped 8 x A100 80 GB node


def test_34b_sft_at_32768_fits_unshared_with_offload_and_each_share_halves_what_the_passes_hold():
    plans = {n: shipped("llama34b_dpo_8xa100", "sft", max_len=32768, sequence_parallel=n) for n in (1, 2, 4, 8)}
    assert all(p.fits for p in plans.values())  # ZeRO-3 + optimizer offload + checkpointing: 72 GiB at N=1
    for n in (2, 4, 8):
        assert activations(plans[n]) / activations(plans[1]) == pytest.approx(1 / n, rel=0.01)
        # each process the logits of its own positions (bf16, and their gradient; the fp32 chunk stays)
        assert logits(plans[1]) - logits(plans[n]) == pytest.approx((1 - 1 / n) * 32768 * (2 * 2 * 32000 + 8), rel=1e-6)
        assert plans[n].memory.gpu_peak < plans[n // 2].memory.gpu_peak
        assert plans[n].time.sequence_exchange_s > plans[n // 2].time.sequence_exchange_s
    assert 600 < plans[1].time.step_s < plans[2].time.step_s < plans[8].time.step_s  # ~11 min a step
    assert plans[8].data_parallel == 1


def test_34b_sft_at_32768_without_offload_fits_one_node_shared_by_eight_or_by_four_with_its_inputs_on_the_host():
    p = shipped("llama34b_dpo_8xa100", "sft", max_len=32768, optimizer_offload=False)
    assert p.fits is False
    assert shipped("llama34b_dpo_8xa100", "sft", max_len=32768, optimizer_offload=False, sequence_parallel=8).fits
    for n in (2, 4):  # 93.1 and 82.8 GiB of 79.3
        assert shipped("llama34b_dpo_8xa100", "sft", max_len=32768, optimizer_offload=False,
                       sequence_parallel=n).fits is False
    shared = [s for s in p.suggestions if set(s.changes) == {"sequence_parallel", "checkpoint_offload"}]
    assert shared and shared[0].changes["sequence_parallel"] == 4 and shared[0].estimate.fits


def test_34b_dpo_at_32768_pairs_fits_shared_by_two():
    p = shipped("llama34b_dpo_8xa100", "dpo", max_len=32768)  # 65,536 tokens a pair
    assert p.fits is False
    assert p.suggestions[0].changes == {"sequence_parallel": 2} and p.suggestions[0].estimate.fits
    assert p.suggestions[0].estimate.time.step_s > p.time.step_s  # the exchange is extra time


# --------------------------------------------------------------------------- the rules


def test_an_n_the_heads_refuse_is_a_clear_error_naming_the_shares_that_work():
    with pytest.raises(InvalidInput) as err:
        seeds_rm(sequence_parallel=3)
    message = err.value.message
    assert message.startswith("stage.sequence_parallel: 3 does not divide the model's 32 attention heads")
    assert "on 6 processes it can be 2" in message
    spec = PipelineSpec.model_validate({
        "name": "p", "cluster": {"gpu": "a100-80gb", "gpus_per_node": 8},
        "stages": [{"name": "sft", "kind": "sft", "model": "01-ai/Yi-34B", "data": {"path": "builtin:digits"},
                    "sequence_parallel": 8}]})  # 56 heads: 8 divides 56 and its 8 KV heads; 4 too, 2 too
    assert plan.plan_pipeline(spec)[0].data_parallel == 1
    yi = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"gpus_per_node": 6})})
    with pytest.raises(InvalidInput, match=r"stages\[0\] \(sft\)\.sequence_parallel: 8 does not divide the stage's 6"):
        plan.plan_pipeline(yi)


def test_exchange_bytes_are_q_k_v_and_output_over_the_others_share():
    shape = shapes.resolve_shape(LLAMA3_8B)
    knobs = plan.Knobs(sequence_parallel=4)
    # 32 layers x 1000 positions x (4096 + 1024 + 1024 + 4096) x 2 B x 3/4
    assert exchange_bytes(shape, 1000, knobs) == 32 * 1000 * 10240 * 2 * 3 / 4
    assert exchange_bytes(shape, 1000, plan.Knobs()) == 0


def test_the_exchange_grows_with_the_tokens_and_crosses_nodes_only_beyond_a_node():
    short, long = seeds_rm(max_len=4096), seeds_rm()
    assert long.time.sequence_exchange_s == pytest.approx(2 * short.time.sequence_exchange_s, rel=0.01)
    stage_spec = load_pipeline("llama34b_dpo_8xa100").stage("sft").model_copy(update={"max_len": 16384})
    shape = shapes.resolve_shape(CODELLAMA_34B)
    four = plan.Hardware.from_cluster(SimpleNamespace(gpu="a100-80gb", gpus_per_node=4, tasks_per_node=None))
    within = plan_stage(stage_spec.model_copy(update={"nodes": 2, "sequence_parallel": 4}), shape, four)
    across = plan_stage(stage_spec.model_copy(update={"nodes": 2, "sequence_parallel": 8}), shape, four)
    assert any("GPU links" in w for w in within.warnings) and any("inter-node network" in w for w in across.warnings)
    # 8 ways sends 7/8 of half as many positions as 4 ways sends 3/4 of: 7/12 the bytes, but at the network's share
    assert across.time.sequence_exchange_s > within.time.sequence_exchange_s


def test_sharing_is_offered_to_the_kinds_that_can_except_with_eager_attention():
    shape = shapes.resolve_shape(LLAMA3_8B)
    hw = plan.Hardware.from_cluster(SimpleNamespace(gpu="a100-80gb", gpus_per_node=8, tasks_per_node=None))
    from pipeline.plan.fixes import sequence_shares

    assert sequence_shares(plan.Knobs(kind="sft"), shape, hw) == [2, 4, 8]
    assert sequence_shares(plan.Knobs(kind="ppo"), shape, hw) == [2, 4, 8]
    assert sequence_shares(plan.Knobs(kind="sft", attention="eager"), shape, hw) == []
    assert sequence_shares(plan.Knobs(kind="sft", sequence_parallel=8), shape, hw) == []


def test_an_rl_stage_shares_its_scoring_and_training_passes_and_samples_whole():
    whole, shared = (shipped("llama2_7b_ppo_4xa100", "ppo", sequence_parallel=n) for n in (1, 2))

    def held(p, name: str) -> float:
        return sum(i.bytes for i in p.memory.items if i.name.startswith(name))

    for name in ("actor activations (checkpointed: layer inputs + one layer recomputed)",
                 "actor activation gradients", "reference forward activations"):
        assert held(shared, name) == pytest.approx(held(whole, name) / 2, rel=0.01), name
    assert held(shared, "KV cache for generation") == held(whole, "KV cache for generation") > 0
    assert whole.time.sequence_exchange_s == 0 < shared.time.sequence_exchange_s
    assert shared.data_parallel == 2


def test_the_json_plan_has_the_share_and_the_data_parallel_groups():
    payload = plan.plan_to_json([seeds_rm()])["stages"][0]
    assert payload["settings"]["sequence_parallel"] == 2 and payload["data_parallel"] == 3 and payload["processes"] == 6
    assert payload["time"]["sequence_exchange_s"] > 0


# --------------------------------------------------------------------------- logits_tile


def test_a_tiled_head_holds_one_tile_of_logits_and_runs_the_head_once_more():
    whole = shipped("llama34b_dpo_8xa100", "sft", max_len=32768)
    tiled = shipped("llama34b_dpo_8xa100", "sft", max_len=32768, logits_tile=1024)
    # bf16 logits and their gradient for 1024 positions instead of 32,768 (less 24 rows of the fp32
    # chunk, which held 1,048 rows of the 32K vocabulary)
    assert logits(whole) - logits(tiled) == pytest.approx((32768 - 1024) * 2 * 2 * 32000, rel=0.005)
    assert any("one tile of 1024 positions" in i.name for i in tiled.memory.items)
    # the head's matmul once more in the backward: 2 x hidden x vocab FLOPs a position
    extra = tiled.time.work["matmul_flops"] - whole.time.work["matmul_flops"]
    assert extra > 0 and whole.time.step_s < tiled.time.step_s < 1.01 * whole.time.step_s


def test_a_tile_is_offered_among_the_fixes_that_keep_the_training():
    # Llama-3-8B SFT with LoRA at 8,192 tokens, 24,576 tokens a micro batch on 6 x 24 GB: 26.5 GiB
    from pipeline.plan.estimate import estimate_stage
    from pipeline.plan.fixes import logits_tile_for, suggest

    assert logits_tile_for(128256) == 1024 and logits_tile_for(32000) == 4096 and logits_tile_for(10**9) == 64
    rm = shipped("llama3_8b_rm_8k_6x4090", "rm")
    sft = replace(rm.knobs, kind="sft", micro_batch_tokens=24576, sequence_parallel=1)
    shape, hw = shapes.resolve_shape(LLAMA3_8B), hardware_of(load_pipeline("llama3_8b_rm_8k_6x4090"))
    assert not estimate_stage(sft, shape, hw).fits
    offered = [s for s in suggest(sft, shape, hw) if "logits_tile" in s.changes]
    assert offered and offered[0].changes["logits_tile"] == 1024 and not offered[0].changes_training
    assert offered[0].estimate.fits


# --------------------------------------------------------------------------- mlp_tiles


def test_tiled_mlps_hold_one_tile_of_intermediates_and_run_the_mlp_once_more():
    # CodeLlama-34B SFT at 32,768 tokens on the shipped 8 A100 (checkpointed, optimizer offloaded):
    # hidden 8192, MLP width 22,016, 48 layers, 32,768 positions a micro batch
    from core.flops import matmul_flops_per_position

    h, i, positions = 8192, 22016, 32768
    whole = shipped("llama34b_dpo_8xa100", "sft", max_len=positions)
    tiled = shipped("llama34b_dpo_8xa100", "sft", max_len=positions, mlp_tiles=4)
    # the recomputed layer counts the MLP's input (2h bytes a position) instead of its four bf16
    # intermediates (8i), its backward no gradients of the MLP's product's factors (4i), and one tile
    # of 8,192 positions holds its intermediates and their gradients (16i)
    assert activations(whole) - activations(tiled) == pytest.approx(positions * (8 * i - 2 * h + 4 * i) - 8192 * 16 * i)
    assert any("one tile of 8,192 positions (mlp_tiles 4)" in item.name for item in tiled.memory.items)
    assert whole.memory.gpu_peak / GiB == pytest.approx(62.7, abs=0.05)
    assert tiled.memory.gpu_peak / GiB == pytest.approx(57.4, abs=0.05)
    # the MLP's forward once more in the backward (2 x 3hi FLOPs a position and layer), beside the 4
    # passes of every matmul (forward, recompute, backward x2)
    shape = shapes.resolve_shape(CODELLAMA_34B)
    extra = tiled.time.work["matmul_flops"] / whole.time.work["matmul_flops"] - 1
    assert extra == pytest.approx(6 * h * i * 48 / (4 * matmul_flops_per_position(shape, "lm")), rel=1e-9)
    assert 11.2 * 60 < whole.time.step_s < 11.4 * 60 and 12.2 * 60 < tiled.time.step_s < 12.4 * 60


def test_tiled_mlps_are_offered_where_a_long_max_len_does_not_fit():
    # The same SFT at 49,152 tokens needs 83.3 GiB of 79.3; 6 tiles of 8,192 positions make it fit
    from pipeline.plan.fixes import mlp_tiles_for, settings_relaxed, suggest

    long = shipped("llama34b_dpo_8xa100", "sft", max_len=49152)
    shape, hw = shapes.resolve_shape(CODELLAMA_34B), hardware_of(load_pipeline("llama34b_dpo_8xa100"))
    assert not long.memory.fits and long.memory.gpu_peak / GiB == pytest.approx(83.3, abs=0.05)
    assert mlp_tiles_for(long.knobs, shape) == 6
    assert mlp_tiles_for(replace(long.knobs, sequence_parallel=8), shape) == 2  # 6,144 positions a process
    offered = [s for s in suggest(long.knobs, shape, hw) if s.changes == {"mlp_tiles": 6}]
    assert offered and not offered[0].changes_training and offered[0].estimate.fits
    assert offered[0].estimate.memory.gpu_peak / GiB == pytest.approx(74.0, abs=0.05)
    tiled = replace(long.knobs, mlp_tiles=6)
    assert [s.description for s in settings_relaxed(tiled, shape, hw) if s.changes == {"mlp_tiles": None}]
