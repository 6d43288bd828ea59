"""Every family the planner counts (core/families.py), counted exactly: a tiny random model of
each, built by the installed transformers from the config.json the planner reads, has the
parameters the planner says, tensor by tensor. A family this transformers does not have is
skipped, saying so (the pinned stack, 4.38.2, predates most of them)."""

from __future__ import annotations

import json

import pytest
from packaging.version import Version

from core import families, flops, shapes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)
LATENT = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1)

# model_type -> the tiny config's own fields (4 experts for every mixture of experts), and variants
# that switch on what a family builds only on request (biases, dense layers between expert ones).
CASES = {
    "llama": {},
    "llama+biases": dict(attention_bias=True, mlp_bias=True),
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3+biases": dict(attention_bias=True),
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "olmo": {},
    "olmo2": {},
    "granite": dict(attention_bias=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, **EXPERTS),
    "qwen3_moe+dense layer": dict(num_experts=4, mlp_only_layers=[0], **EXPERTS),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=48, **EXPERTS),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                        **EXPERTS, **LATENT),
    "deepseek_v2": dict(n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None,
                        **EXPERTS, **LATENT),
}


def test_every_counted_family_has_a_case():
    assert {case.split("+")[0] for case in CASES} == set(shapes.COUNTED_FAMILIES)


# Cases whose fields an older transformers ignores (it builds what it knows whatever config.json says).
SINCE = {"llama+biases": ("4.41", "mlp_bias")}


def _tiny_config(model_type: str, fields: dict):
    try:
        return transformers.AutoConfig.for_model(model_type, **TINY, **fields)
    except (ValueError, KeyError):
        pytest.skip(f"transformers {transformers.__version__} has no model_type '{model_type}'")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the planner's shape read from the saved config.json, the model transformers builds)."""
    cache = {}

    def build(case: str):
        if case in SINCE and Version(transformers.__version__) < Version(SINCE[case][0]):
            pytest.skip(f"transformers {transformers.__version__} has no {SINCE[case][1]} (since {SINCE[case][0]})")
        if case not in cache:
            model_type = case.split("+")[0]
            config = _tiny_config(model_type, CASES[case])
            folder = tmp_path_factory.mktemp(case.replace("+", "_").replace(" ", "_"))
            config.save_pretrained(folder)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config)
            cache[case] = shapes.read_config_json(folder / "config.json"), model
        return cache[case]

    return build


@pytest.mark.parametrize("case", CASES)
def test_the_planner_counts_every_parameter(case, built):
    shape, model = built(case)
    assert shape.is_counted
    assert shape.n_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", CASES)
def test_the_planner_knows_every_parameter_tensor(case, built):
    shape, model = built(case)
    if Version(transformers.__version__) < Version("5") and shape.is_moe:
        pytest.skip("transformers 4 keeps each expert in Linears of its own (the count is the same)")
    assert sorted(shape.parameter_tensors("lm")) == sorted(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].get("num_experts_per_tok")])
def test_an_expert_model_counts_all_experts_in_memory_and_the_active_ones_in_flops(case, built):
    shape, _ = built(case)
    dense = shapes.ModelShape(hidden=shape.hidden, intermediate=shape.expert_intermediate, layers=shape.layers,
                              heads=shape.heads, kv_heads=shape.kv_heads, vocab=shape.vocab, max_positions=64)
    expert_layers = shape.expert_layers
    assert expert_layers >= 1 and shape.experts == 4 and shape.experts_per_token == 2
    # every expert's weights are held; a token multiplies by 2 of the 4, and by the router
    assert shape.n_params - shape.active_params_with_head("lm") == expert_layers * 2 * shape.expert_params
    router = shape.experts * shape.hidden * expert_layers
    assert shape.mlp_active_params >= expert_layers * (3 * shape.hidden * 2 * shape.expert_intermediate) + router
    assert flops.matmul_flops_per_position(shape, "lm") == 2 * (shape.active_params_with_head("lm")
                                                               - shape.embedding_params)
    assert shape.n_params > dense.n_params


def test_a_hub_config_names_the_experts_as_older_transformers_wrote_them(built):
    shape, _ = built("qwen3_moe")
    hub = {k: v for k, v in json.loads(json.dumps(_tiny_config("qwen3_moe", CASES["qwen3_moe"]).to_dict())).items()}
    hub["num_experts"] = hub.pop("num_local_experts", hub.get("num_experts"))
    assert shapes.from_config_json(hub) == shape


def test_an_unknown_mixture_of_experts_is_refused_with_the_reason():
    config = {**TINY, "model_type": "brand_new_moe", "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match="brand_new_moe.*mixture of experts.*num_local_experts.*mixtral"):
        shapes.from_config_json(config)


def test_an_unknown_dense_family_is_estimated_and_says_so():
    shape = shapes.from_config_json({**TINY, "model_type": "brand_new_dense"})
    assert not shape.is_counted and shape.n_params > 0
    assert {t for t, f in families.FAMILIES.items() if not f.counted} == {"yi", "internlm2"}
