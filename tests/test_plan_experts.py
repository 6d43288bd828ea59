"""Mixtures of experts in the plan: every expert held, the active ones computed, a family the
planner cannot count refused. Sizes checked against the published ones; the per-tensor count
against transformers' own models in test_shape_families.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from core import flops, kinds, shapes
from core.config import PipelineSpec
from core.errors import EXIT_INVALID, InvalidInput
from pipeline import plan

# total and active parameters as their makers publish them (gpt-oss counts active ones without the
# input embedding, a lookup; the others with it)
PUBLISHED = {
    "mistralai/Mixtral-8x7B-v0.1": (46.7e9, 12.9e9, True),
    "Qwen/Qwen3-30B-A3B": (30.5e9, 3.3e9, True),
    "openai/gpt-oss-20b": (20.9e9, 3.6e9, False),
    "deepseek-ai/DeepSeek-V3": (671e9, 37e9, True),
}


@pytest.mark.parametrize("hub_id", PUBLISHED)
def test_expert_models_have_their_published_total_and_active_sizes(hub_id):
    shape, (total, active, with_embedding) = shapes.BUILTIN_SHAPES[hub_id], PUBLISHED[hub_id]
    counted = shape.active_params_with_head("lm") - (0 if with_embedding else shape.embedding_params)
    assert shape.n_params == pytest.approx(total, rel=0.01)
    assert counted == pytest.approx(active, rel=0.03)


def _stage(**fields):
    spec = dict(name="s", kind="sft", model="builtin:tiny-llama", data={"path": "builtin:digits"}, precision="bf16",
                zero_stage=3, gradient_checkpointing=True, attention="flash_attention_2", max_len=4096,
                micro_batch_size=1)
    spec.update(fields)
    return kinds.get(spec["kind"]).schema.model_validate(spec)


def _node(gpus=8):
    return plan.Hardware.from_cluster(SimpleNamespace(gpu="h100-80gb", gpus_per_node=gpus, tasks_per_node=None))


def _states(memory):
    return sum(i.bytes for i in memory.items if i.phase == "always" and i.where == "gpu"
               and i.category in ("weights", "gradients", "optimizer"))


def test_an_expert_model_holds_every_expert_where_a_dense_one_holds_one():
    mixtral = shapes.BUILTIN_SHAPES["mistralai/Mixtral-8x7B-v0.1"]
    mistral = shapes.BUILTIN_SHAPES["mistralai/Mistral-7B-v0.1"]  # the same layer without experts
    assert (mixtral.hidden, mixtral.expert_intermediate, mixtral.layers) == (
        mistral.hidden, mistral.intermediate, mistral.layers)
    moe, dense = (plan.plan_stage(_stage(), s, _node()) for s in (mixtral, mistral))
    extra_experts = (mixtral.experts - 1) * mixtral.layers * 3 * mixtral.hidden * mixtral.expert_intermediate
    # 16 bytes a trained parameter (bf16 weight and gradient, fp32 master, m, v), over 8 GPUs
    assert _states(moe.memory) - _states(dense.memory) >= 16 * extra_experts / 8 * 0.999
    # planned as dense (the 8x undercount), Mixtral fitted 8 H100s with a full fine-tune; it does not
    assert dense.fits and not moe.fits and moe.total_params == mixtral.n_params


def test_an_expert_model_computes_the_experts_each_token_goes_through_and_the_router():
    mixtral = shapes.BUILTIN_SHAPES["mistralai/Mixtral-8x7B-v0.1"]
    h, i, layers = mixtral.hidden, mixtral.expert_intermediate, mixtral.layers
    attention = sum(a * b for a, b in mixtral.attention_linears().values())
    per_layer = attention + 8 * h + 2 * 3 * h * i  # attention, the router over 8 experts, 2 experts of 3 products
    assert flops.matmul_flops_per_position(mixtral, "lm") == 2 * (layers * (per_layer + 2 * h) + h
                                                                   + mixtral.vocab * h)
    moe = plan.plan_stage(_stage(), mixtral, _node()).time
    assert moe.model_flops_per_token < 0.3 * 6 * mixtral.n_params
    assert any("mixture of experts" in note for note in moe.notes)


def _pipeline(model):
    return PipelineSpec.model_validate({
        "name": "p", "cluster": {"gpu": "h100-80gb", "gpus_per_node": 8},
        "stages": [{"name": "sft", "kind": "sft", "model": str(model), "data": {"path": "builtin:digits"}}]})


def test_a_mixture_of_experts_of_a_family_the_planner_cannot_count_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "brand_new_moe", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2}))
    with pytest.raises(InvalidInput) as err:
        plan.plan_pipeline(_pipeline(tmp_path))
    assert err.value.exit_code == EXIT_INVALID
    assert "stages[0] (sft).model" in err.value.message and "mixture of experts" in err.value.message


def test_a_family_the_planner_estimates_says_so_in_the_plan(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "internlm2", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 128}))
    counted = plan.plan_pipeline(_pipeline("meta-llama/Llama-2-7b-hf"))[0]
    estimated = plan.plan_pipeline(_pipeline(tmp_path))[0]
    assert not any("estimated" in w for w in counted.warnings)
    assert any("'internlm2' is estimated, not counted" in w for w in estimated.warnings)
