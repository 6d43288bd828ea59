"""The planner's vLLM terms (pipeline/plan/rollout_engine.py): the engine's memory, its decoding
time and the weight sync against hand-worked numbers, and the 34B GRPO stage on one node of
8 A100 80 GB that transformers' generation cannot fit."""

from __future__ import annotations

import pytest

from core import shapes
from pipeline import plan
from pipeline.plan import rollout_engine
from pipeline.plan.inputs import PPOWorkload
from tests.test_plan import CODELLAMA_34B, GiB, node, stage

# hidden 1024, 4 layers, 8 heads of 128, 4 key-value heads, vocabulary 1000
SMALL = shapes.ModelShape(hidden=1024, intermediate=4096, layers=4, heads=8, kv_heads=4, vocab=1000,
                          max_positions=4096)


def test_the_engine_holds_its_share_of_the_weights_and_a_kv_cache_in_the_rest_of_its_memory_share():
    engine = rollout_engine.engine_memory(SMALL, weight_bytes=2, tensor_parallel=2, memory_share=0.5,
                                          gpu_bytes=1 * GiB, longest=1024)
    assert engine.weights == SMALL.n_params * 2 // 2
    assert engine.kv_cache == GiB // 2 - engine.weights
    # one sequence: K and V x 4 layers x 2 of the 4 key-value heads x 128 x 2 bytes x 1024 tokens = 4 MiB
    assert engine.sequence_kv == 2 * 4 * 2 * 128 * 2 * 1024 == 4 * 2**20
    assert engine.sequences == engine.kv_cache // (4 * 2**20)
    assert engine.sync_module == 4096 * 1024 * 2  # the MLP's projection, larger than the 1000-token embedding
    # a share that does not hold the weights holds no sequence
    assert rollout_engine.engine_memory(SMALL, 2, 1, 0.001, GiB, 1024).sequences == 0


def test_decoding_reads_a_processes_share_of_the_weights_and_the_kv_cache_once_per_token_step():
    weights = SMALL.n_params * 2
    kv_per_token = 2 * 4 * 2 * 128 * 2  # bytes per token, tensor_parallel 2
    # 100 sequences, 40 at a time: 3 rounds of 10 steps, each reading half the weights and 40 caches of
    # (prompt 20 + on average half of 10 new) tokens
    step = weights / 2 + 40 * (20 + 5) * kv_per_token
    assert rollout_engine.decode_s(SMALL, 2, 2, sequences=100, prompt_len=20, new_tokens=10, concurrent=40,
                                   hbm_bytes_per_s=1e9) == pytest.approx(3 * 10 * step / 1e9)
    # at most 256 at once (vLLM's max_num_seqs), at least one
    capped = rollout_engine.decode_s(SMALL, 2, 2, 512, 20, 10, concurrent=10_000, hbm_bytes_per_s=1e9)
    assert capped == pytest.approx(2 * 10 * (weights / 2 + 256 * 25 * kv_per_token) / 1e9)


def test_the_sync_moves_every_weight_once_gathered_under_zero3_then_copied():
    weights = SMALL.n_params * 2
    assert rollout_engine.sync_s(SMALL, 2, zero3_ring_bytes_per_s=1e9, hbm_bytes_per_s=1e10) == pytest.approx(
        weights / 1e9 + weights / 1e10)
    assert rollout_engine.sync_s(SMALL, 2, 0.0, 1e10) == pytest.approx(weights / 1e10)


def grpo_34b(**fields):
    """The issue's case: a GRPO stage with the shipped 34B file's settings (bf16, ZeRO-3 + optimizer
    offload, checkpointing, flash attention, max_len 2048, 1,024 new tokens, 64 prompts x 8
    samples a rollout), one node of 8 A100 80 GB."""
    spec = dict(kind="ppo", zero_stage=3, optimizer_offload=True, gradient_checkpointing=True, global_batch_size=64,
                max_new_tokens=1024, rollout_batch_size=64)
    spec.update(fields)
    rl = stage(**spec)
    rollouts = PPOWorkload(samples_per_prompt=rl.n_samples_per_prompt, rollout_rows=rl.rollout_batch_size,
                           scoring_batch=rl.micro_rollout_batch_size, new_tokens=rl.max_new_tokens)
    return plan.plan_stage(rl, shapes.resolve_shape(CODELLAMA_34B), node(), ppo=rollouts, model_name=CODELLAMA_34B)


def test_the_34b_grpo_stage_that_transformers_cannot_sample_fits_with_vllm_offered_first():
    hf = grpo_34b()
    assert not hf.estimate.fits and hf.memory.peak("gpu")[1] == "generation"
    first = hf.suggestions[0]
    assert first.changes == {"vllm_tensor_parallel": 8, "vllm_sleep": True} and first.estimate.fits
    assert "generation: vllm, vllm: {tensor_parallel: 8, sleep: true}" in first.description

    engine = grpo_34b(generation="vllm", vllm={"tensor_parallel": 8, "sleep": True})
    assert engine.estimate.fits
    weights = next(i for i in engine.memory.items if i.name.startswith("vLLM engine: 1/8"))
    assert weights.bytes == pytest.approx(shapes.resolve_shape(CODELLAMA_34B).n_params * 2 / 8, rel=1e-6)
    assert weights.phase == "generation"  # released while the actor trains
    # sampling: tens of seconds of the rollout, where transformers' generation took minutes
    assert engine.estimate.time.step_s < hf.estimate.time.step_s - 120


def test_without_sleep_the_engine_holds_its_share_while_the_actor_trains():
    awake = grpo_34b(generation="vllm", vllm={"tensor_parallel": 8, "sleep": False})
    held = [i for i in awake.memory.items if i.name.startswith("vLLM engine")]
    assert held and all(i.phase == "always" for i in held)
    asleep = grpo_34b(generation="vllm", vllm={"tensor_parallel": 8, "sleep": True})
    assert awake.memory.peak("gpu")[0] > asleep.memory.peak("gpu")[0]
