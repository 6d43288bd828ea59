"""The planner: GPU catalogue, model shapes, memory and time estimates, suggestions.

Expected numbers are worked by hand here (bytes per parameter, published
parameter counts, peft's printed trainable-parameter counts), not read back from
the code. The model-state bytes are checked against real DeepSpeed allocations
in test_plan_vs_deepspeed.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from core import hardware, kinds, shapes
from core.config import CONFIGS_DIR, LoraSpec, PipelineSpec, load_pipeline
from core.errors import EXIT_DOES_NOT_FIT, EXIT_INVALID, DoesNotFit, InvalidInput
from pipeline import plan
from pipeline.hfcache import hf_cache
from pipeline.plan import format_plan, plan_pipeline

GiB = 1024**3
CODELLAMA_34B = "codellama/CodeLlama-34b-hf"
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def stage(**fields):
    """A stage spec as the pipeline file would give it (its kind's schema, validated)."""
    spec = dict(name="s", kind="sft", model="builtin:tiny-llama", data={"path": "builtin:digits"}, precision="bf16",
                zero_stage=2, optimizer_offload=False, gradient_checkpointing=False, attention="flash_attention_2",
                lora=None, max_len=2048, micro_batch_size=1, global_batch_size=None, epochs=1, max_steps=None, nodes=1)
    if fields.get("kind") == "ppo":
        spec["reward"] = {"rules": [{"rule": "exact_match"}]}
    spec.update(fields)
    return kinds.get(spec["kind"]).schema.model_validate(spec)


def node(gpu="a100-80gb", gpus=8, **fields):
    return plan.Hardware.from_cluster(SimpleNamespace(gpu=gpu, gpus_per_node=gpus, tasks_per_node=None, **fields))


def item(memory, text, phase=None):
    """Bytes of the one item whose name contains `text` (and is in `phase`, if given); a tensor held
    at several moments of the backward (pipeline/plan/memory.py) is listed in each, with the same bytes."""
    found = [i for i in memory.items if text in i.name and (phase is None or i.phase == phase)]
    assert found and len({(i.name, i.bytes) for i in found}) == 1, [i.name for i in memory.items]
    return found[0].bytes


def model_states(memory, role="policy"):
    return sum(i.bytes for i in memory.items if i.name.startswith(role) and i.phase == "always"
               and i.category in ("weights", "gradients", "optimizer") and i.where == "gpu")


def dpo_34b(**fields):
    """The headline case: CodeLlama-34B full-parameter DPO, bf16, ZeRO-3, checkpointing,
    flash attention, micro batch 1, max_len 2048, global batch 64, one node of 8 A100 80 GB."""
    spec = dict(kind="dpo", zero_stage=3, gradient_checkpointing=True, reference="live", global_batch_size=64)
    spec.update(fields)
    return plan.plan_stage(stage(**spec), shapes.resolve_shape(CODELLAMA_34B), node(), model_name=CODELLAMA_34B)


# --------------------------------------------------------------------------- hardware


def test_catalogue_has_the_gpus_pipeline_files_name():
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h200", "l40s", "rtx4090", "rtx3090",
                 "a6000", "v100-32gb"):
        assert hardware.gpu(name).name == name


def test_gpu_names_are_case_insensitive():
    assert hardware.gpu("A100-80GB") is hardware.gpu("a100-80gb")


def test_unknown_gpu_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        hardware.gpu("a100")  # ambiguous: 40 or 80 GB
    assert "a100-80gb" in str(err.value) and "rtx4090" in str(err.value)


def test_usable_memory_is_below_the_marketing_number():
    for name, nominal_gb in (("a100-80gb", 80), ("h100-80gb", 80), ("rtx4090", 24), ("a100-40gb", 40)):
        gib = hardware.gpu(name).memory_gib
        assert nominal_gb * 1e9 / GiB * 0.95 < gib < nominal_gb * 1e9 / GiB * 1.07


def test_peak_rates_follow_the_data_sheets():
    assert hardware.gpu("a100-80gb").peak_tflops("bf16") == 312
    assert 985 <= hardware.gpu("h100-80gb").peak_tflops("bf16") <= 990
    assert hardware.gpu("rtx4090").peak_tflops("bf16") == pytest.approx(165.2)  # fp32 accumulation
    assert hardware.gpu("v100-32gb").peak_tflops("bf16") == hardware.gpu("v100-32gb").fp32_tflops


def test_consumer_and_pcie_cards_have_no_nvlink():
    assert {g.name for g in hardware.GPUS.values() if g.interconnect == "pcie"} == {
        "h100-pcie", "l40s", "rtx4090", "rtx3090", "a6000"}


def test_host_memory_comes_from_slurm_mem_then_the_catalogue():
    assert node(mem="256G").host_memory_bytes == 256 * GiB
    assert node(mem="0").host_memory_bytes == hardware.gpu("a100-80gb").host_memory_gib * GiB


# --------------------------------------------------------------------------- shapes

# Parameter counts from MODELS.md (their published sizes).
PUBLISHED = {
    "meta-llama/Llama-2-7b-hf": 6.74e9,
    "meta-llama/Llama-2-13b-hf": 13.0e9,
    "meta-llama/Llama-2-70b-hf": 69.0e9,
    "codellama/CodeLlama-34b-hf": 33.7e9,
    "01-ai/Yi-34B": 34.4e9,
    "01-ai/Yi-34B-200K": 34.4e9,
    "meta-llama/Meta-Llama-3-8B": 8.03e9,
    "meta-llama/Meta-Llama-3-70B": 70.6e9,
    "mistralai/Mistral-7B-v0.1": 7.24e9,
    "Qwen/Qwen1.5-7B": 7.7e9,
    "Qwen/Qwen1.5-1.8B": 1.84e9,
}


@pytest.mark.parametrize("hub_id", PUBLISHED)
def test_parameter_count_matches_the_published_size(hub_id):
    assert shapes.resolve_shape(hub_id).n_params == pytest.approx(PUBLISHED[hub_id], rel=0.01)


def test_tinyllama_parameter_count_is_exact():
    tiny = shapes.ModelShape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000,
                             max_positions=2048)
    assert tiny.n_params == 1_100_048_384  # TinyLlama-1.1B's model card


LLAMA2_7B_CONFIG = {  # meta-llama/Llama-2-7b-hf config.json
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "float16", "vocab_size": 32000,
}


def test_config_json_gives_the_builtin_shape():
    assert shapes.from_config_json(LLAMA2_7B_CONFIG) == shapes.BUILTIN_SHAPES["meta-llama/Llama-2-7b-hf"]


def test_config_json_without_sizes_is_refused():
    with pytest.raises(ValueError, match="hidden_size"):
        shapes.from_config_json({"model_type": "llama", "vocab_size": 10})


def test_qwen2_has_qkv_biases_and_tied_defaults_follow_transformers():
    qwen = shapes.from_config_json({**LLAMA2_7B_CONFIG, "model_type": "qwen2"})
    assert qwen.qkv_bias and qwen.n_params - shapes.from_config_json(LLAMA2_7B_CONFIG).n_params == 32 * 3 * 4096
    gpt = shapes.from_config_json(
        {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257})
    assert gpt.tied_embeddings and not gpt.is_counted


def test_a_local_folder_is_read_first(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_7B_CONFIG, "num_hidden_layers": 2}))
    assert shapes.resolve_shape(str(tmp_path)).layers == 2


def test_a_peft_adapter_folder_has_its_base_models_shape(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": CODELLAMA_34B}))
    assert shapes.resolve_shape(str(tmp_path)) == shapes.BUILTIN_SHAPES[CODELLAMA_34B]


def _cache_model(root, hub_id, config, revision="abc123"):
    repo = root / ("models--" + hub_id.replace("/", "--"))
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_the_hub_cache_beats_the_builtin_table(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _cache_model(tmp_path, CODELLAMA_34B, {**LLAMA2_7B_CONFIG, "num_hidden_layers": 3})
    assert shapes.resolve_shape(CODELLAMA_34B, hf_cache().hub).layers == 3


def test_hf_home_locates_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    _cache_model(tmp_path / "hub", "my-org/my-model", LLAMA2_7B_CONFIG)
    assert shapes.resolve_shape("my-org/my-model", hf_cache().hub) == shapes.BUILTIN_SHAPES["meta-llama/Llama-2-7b-hf"]


def test_an_unknown_model_says_how_to_get_its_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(shapes.ShapeNotFound) as err:
        shapes.resolve_shape("my-org/unknown-model", hf_cache().hub)
    message = str(err.value)
    assert "download" in message and "local folder" in message and str(tmp_path) in message


def test_builtin_tiny_llama_has_the_stages_tiny_shape():
    tiny = shapes.resolve_shape("builtin:tiny-llama")
    assert (tiny.hidden, tiny.intermediate, tiny.layers, tiny.heads, tiny.kv_heads, tiny.max_positions) == (
        64, 176, 2, 2, 2, 64)
    assert tiny.vocab == 4 + 44  # <pad> <s> </s> <unk> + digits, letters and 8 punctuation characters
    assert not tiny.tied_embeddings


def test_planning_imports_no_gpu_libraries():
    code = ("import sys; from pipeline import plan; from core.config import load_pipeline; "
            "plan.format_plan(plan.plan_pipeline(load_pipeline('tiny'))); "
            "bad = [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- LoRA


def test_lora_trainable_counts_match_peft():
    llama2 = shapes.BUILTIN_SHAPES["meta-llama/Llama-2-7b-hf"]
    llama3 = shapes.BUILTIN_SHAPES["meta-llama/Meta-Llama-3-8B"]
    # the counts peft's print_trainable_parameters reports for these models
    assert llama2.lora_params(8, ["q_proj", "v_proj"]) == 4_194_304
    assert llama2.lora_params(16, ALL_LINEAR) == 39_976_960
    assert llama3.lora_params(16, ALL_LINEAR) == 41_943_040  # grouped-query k/v are narrower


def test_lora_on_an_unknown_layer_is_an_error():
    with pytest.raises(ValueError, match="c_attn"):
        shapes.BUILTIN_SHAPES["meta-llama/Llama-2-7b-hf"].lora_params(8, ["c_attn"])


def test_lora_leaves_only_adapter_states_on_the_gpu():
    shape = shapes.BUILTIN_SHAPES["meta-llama/Llama-2-7b-hf"]
    lora = LoraSpec(rank=16)
    memory = plan.plan_stage(stage(zero_stage=2, lora=lora), shape, node()).memory
    adapters = 39_976_960
    assert item(memory, "policy fp32 master + Adam") == pytest.approx(12 * adapters / 8, rel=0.001)
    assert item(memory, "policy gradients") == pytest.approx(2 * adapters / 8, rel=0.001)
    # frozen base + adapters, whole in bf16 (ZeRO-2 does not shard weights)
    assert item(memory, "policy weights") == 2 * (shape.n_params + adapters)


# --------------------------------------------------------------------------- model states worked by hand

TINYLLAMA = shapes.ModelShape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000,
                              max_positions=2048)
N1B = 1_100_048_384


def test_one_billion_params_zero3_bf16_is_16_bytes_per_param_over_8_gpus():
    memory = plan.plan_stage(stage(zero_stage=3), TINYLLAMA, node()).memory
    assert model_states(memory) == pytest.approx(16 * N1B / 8, rel=0.002)
    assert item(memory, "policy gradients") == pytest.approx(2 * N1B / 8, rel=0.001)
    assert item(memory, "fp32 gradients for the step", "optimizer step") == pytest.approx(4 * N1B / 8, rel=0.001)


def test_zero2_keeps_the_weights_whole_and_shards_the_rest():
    memory = plan.plan_stage(stage(zero_stage=2), TINYLLAMA, node()).memory
    assert model_states(memory) == pytest.approx(2 * N1B + 14 * N1B / 8, rel=0.001)


def test_zero1_shards_only_optimizer_states_and_the_reduced_gradients():
    memory = plan.plan_stage(stage(zero_stage=1), TINYLLAMA, node()).memory
    assert item(memory, "policy fp32 master + Adam") == pytest.approx(12 * N1B / 8, rel=0.001)


def test_zero0_fp32_is_weights_grads_and_two_moments():
    memory = plan.plan_stage(stage(zero_stage=0, precision="fp32"), TINYLLAMA, node()).memory
    assert model_states(memory) == 16 * N1B  # 4 + 4 + 8, nothing sharded, no master copy


def test_zero0_mixed_precision_holds_a_whole_fp32_master():
    memory = plan.plan_stage(stage(zero_stage=0), TINYLLAMA, node()).memory
    assert model_states(memory) == 16 * N1B  # 2 + 2 + 12
    assert item(memory, "fp32 gradients for the step", "optimizer step") == 4 * N1B


def test_optimizer_offload_moves_states_to_host_ram():
    memory = plan.plan_stage(stage(zero_stage=3, optimizer_offload=True), TINYLLAMA, node()).memory
    assert model_states(memory) == pytest.approx(2 * N1B / 8, rel=0.002)  # only the weight shard stays
    host_states = sum(i.bytes for i in memory.items if i.where == "host" and i.category in ("gradients", "optimizer"))
    # per process: fp32 master + m + v (12) + fp32 gradients (4) + bf16 gradient partition (2)
    assert host_states * 8 == pytest.approx(18 * N1B, rel=0.002)


def test_offload_on_zero0_is_ignored_like_deepspeed_config_does():
    offload = plan.plan_stage(stage(zero_stage=0, optimizer_offload=True), TINYLLAMA, node())
    assert model_states(offload.memory) == 16 * N1B
    assert any("zero_stage 1-3" in w for w in offload.warnings)


# --------------------------------------------------------------------------- activations and logits

LLAMA2_7B = shapes.BUILTIN_SHAPES["meta-llama/Llama-2-7b-hf"]
# bytes per token per layer in bf16: norms 2*(4h+4h), q,k,v,out 2*4h, log-sum-exp 4*32, MLP 4*2*i
LAYER_7B = 16 * 4096 + 8 * 4096 + 4 * 32 + 8 * 11008


def test_activations_without_checkpointing_keep_every_layer():
    memory = plan.plan_stage(stage(), LLAMA2_7B, node()).memory
    assert item(memory, "policy activations") == 2048 * 32 * LAYER_7B


def test_checkpointing_keeps_layer_inputs_and_one_layer():
    memory = plan.plan_stage(stage(gradient_checkpointing=True), LLAMA2_7B, node()).memory
    assert item(memory, "policy activations", "policy backward through the loss") == 2048 * 32 * 2 * 4096
    assert item(memory, "policy activations", "policy backward through the layers") == 2048 * (32 * 2 * 4096 + LAYER_7B)


def test_the_logits_are_gone_before_the_layers_backward_and_the_buckets_come():
    memory = plan.plan_stage(stage(gradient_checkpointing=True), LLAMA2_7B, node()).memory
    phases = {i.phase for i in memory.items if "logits" in i.name}
    assert phases == {"policy backward through the loss"}
    # ZeRO-2's reduce buckets are made at the first gradient's hook and released when the backward ends
    assert {i.phase for i in memory.items if "buckets" in i.name} == {"policy backward through the layers"}
    assert {i.phase for i in memory.items if "activation gradients" in i.name} == {"policy backward through the layers"}


def test_eager_attention_materialises_the_scores():
    flash = plan.plan_stage(stage(), LLAMA2_7B, node()).memory
    eager = plan.plan_stage(stage(attention="eager"), LLAMA2_7B, node()).memory
    scores = 32 * 2048 * 2048 * (4 + 2)  # heads x seq^2, fp32 softmax + its bf16 copy, per layer
    assert item(eager, "policy activations") - item(flash, "policy activations") == 32 * scores


def test_logits_cost_vocab_per_token_and_reward_models_have_none():
    sft = plan.plan_stage(stage(micro_batch_size=2), LLAMA2_7B, node()).memory
    # 4096 positions: logits and their gradient in bf16 (2 + 2 B per entry); fp32 log-prob chunks of
    # 2**25 // 32000 = 1048 rows, up to four fp32 chunk copies at once in the backward; per position an
    # fp32 picked log-prob and log-sum-exp (8 B)
    assert item(sft, "logits") == 4096 * 32000 * (2 + 2) + 4 * 4 * 1048 * 32000 + 8 * 4096
    rm = plan.plan_stage(stage(kind="rm", micro_batch_size=2), LLAMA2_7B, node()).memory
    assert not [i for i in rm.items if i.category == "logits"]
    # a pair per row: twice the tokens of SFT for the same micro batch
    assert item(rm, "activations (32 layers)") == 2 * item(sft, "activations (32 layers)")


def test_a_frozen_model_keeps_its_logits_in_the_model_dtype():
    dpo = plan.plan_stage(stage(kind="dpo", zero_stage=3), LLAMA2_7B, node()).memory
    # a pair of 2048-token sequences: bf16 logits, the forward's three fp32 chunk copies (1048 rows of 32000)
    # and the picked log-prob and log-sum-exp per position
    assert item(dpo, "reference logits", "reference forward") == 4096 * 32000 * 2 + 3 * 4 * 1048 * 32000 + 8 * 4096


def test_the_logprob_chunk_is_the_one_the_loss_uses():
    pytest.importorskip("torch")
    from pipeline.plan import activations
    from stages import losses

    assert activations.LOGPROB_CHUNK_ELEMENTS == losses._CHUNK_ELEMS


TINY = shapes.ModelShape(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=48, max_positions=64)


def test_packed_sdpa_builds_one_additive_mask_per_micro_batch():
    memory = plan.plan_stage(stage(attention="sdpa", max_len=16, micro_batch_size=2), TINY, node()).memory
    # a 32-token budget on lines up to 32 wide: (lines, 1, w, w) bf16 mask over 32 x 32 positions, the bool
    # (lines, w, w) it is built from, and the bool (w, w) causal temporary
    assert item(memory, "attention mask (sdpa)") == 32 * 32 * 2 + 32 * 32 + 32 * 32
    flash = plan.plan_stage(stage(max_len=16, micro_batch_size=2), TINY, node()).memory
    assert item(memory, "policy activations") == item(flash, "policy activations")  # no per-layer mask any more


def test_padded_micro_batches_get_transformers_own_mask():
    sdpa = plan.plan_stage(stage(attention="sdpa", packing=False, max_len=16, micro_batch_size=2), TINY, node())
    eager = plan.plan_stage(stage(attention="eager", packing=False, max_len=16, micro_batch_size=2), TINY, node())
    assert item(sdpa.memory, "attention mask") == 2 * 16 * 16  # (rows, 1, max_len, max_len) bool
    assert item(eager.memory, "attention mask") == 2 * 16 * 16 * 2  # additive, in bf16


def test_flash_attention_takes_no_mask():
    memory = plan.plan_stage(stage(max_len=16, micro_batch_size=2), TINY, node()).memory
    assert not [i for i in memory.items if "mask" in i.name]


def test_micro_batch_tokens_sizes_activations_and_logits():
    small = plan.plan_stage(stage(micro_batch_size=1), LLAMA2_7B, node()).memory
    big = plan.plan_stage(stage(micro_batch_size=1, micro_batch_tokens=4 * 2048), LLAMA2_7B, node()).memory
    assert item(big, "policy activations") == 4 * item(small, "policy activations")
    padded = plan.plan_stage(stage(micro_batch_size=1, micro_batch_tokens=4 * 2048, packing=False), LLAMA2_7B, node())
    assert item(padded.memory, "policy activations") == item(small, "policy activations")  # the budget packs only


def test_the_dpo_reference_runs_while_the_policy_holds_its_forward():
    memory = plan.plan_stage(stage(kind="dpo", zero_stage=3), LLAMA2_7B, node()).memory
    held = item(memory, "held while the reference runs", "reference forward")
    assert held == item(memory, "policy activations") + 4096 * 32000 * 2  # + the policy's bf16 logits


# --------------------------------------------------------------------------- the DPO reference


def test_reference_placements():
    shape = LLAMA2_7B
    live = plan.plan_stage(stage(kind="dpo", zero_stage=3, reference="live"), shape, node()).memory
    offload = plan.plan_stage(stage(kind="dpo", zero_stage=3, reference="offload"), shape, node()).memory
    precompute = plan.plan_stage(stage(kind="dpo", zero_stage=3, reference="precompute"), shape, node()).memory
    assert item(live, "reference weights") == pytest.approx(2 * shape.n_params / 8, rel=0.002)
    assert not [i for i in offload.items if i.name.startswith("reference") and i.where == "gpu" and i.phase == "always"]
    host_reference = sum(i.bytes for i in offload.items if i.name.startswith("reference") and i.where == "host")
    assert host_reference * 8 == pytest.approx(2 * shape.n_params, rel=0.002)  # one bf16 copy over the node
    assert not [i for i in precompute.items if i.name.startswith("reference")]
    assert precompute.gpu_peak <= offload.gpu_peak < live.gpu_peak


def test_a_whole_reference_without_zero3_is_moved_in_for_its_forward():
    memory = plan.plan_stage(stage(kind="dpo", zero_stage=2, reference="offload"), LLAMA2_7B, node()).memory
    assert item(memory, "moved in", "reference forward") == 2 * LLAMA2_7B.n_params


# --------------------------------------------------------------------------- the 34B acceptance case


def test_34b_dpo_model_states_are_68_gb_per_gpu_under_zero3_on_8_gpus():
    states = model_states(dpo_34b().memory)
    assert states == pytest.approx(16 * 33.74e9 / 8, rel=0.01)  # CONTEXT.md: 544 GB / 8 = 68 GB
    assert 66e9 < states < 69e9


def test_34b_dpo_zero3_alone_does_not_fit_one_node():
    p = dpo_34b()
    assert p.fits is False
    assert p.memory.gpu_headroom < -2 * GiB  # short by more than a rounding error
    assert p.memory.gpu_peak > hardware.gpu("a100-80gb").memory_bytes


def test_34b_dpo_fits_one_node_with_optimizer_and_reference_offload():
    p = dpo_34b(optimizer_offload=True, reference="offload")
    assert p.fits is True
    # master + m + v + fp32 grads + bf16 partition (18 B) over 33.7B, plus the bf16 reference: hundreds of GB
    assert 500 * GiB < p.memory.host_peak < 1024 * GiB
    assert p.memory.peak("host")[1] == "always"  # the steady state, not loading, is the host peak


def test_34b_dpo_fits_one_node_with_optimizer_offload_and_precomputed_reference():
    p = dpo_34b(optimizer_offload=True, reference="precompute")
    assert p.fits is True
    assert p.memory.host_peak < dpo_34b(optimizer_offload=True, reference="offload").memory.host_peak


def test_34b_dpo_fits_two_nodes_without_offload():
    p = dpo_34b(nodes=2)
    assert p.world == 16 and p.fits is True
    assert not p.knobs.offloads and p.knobs.reference == "live"


def test_34b_dpo_optimizer_offload_needs_more_host_ram_than_a_small_node_has():
    p = plan.plan_stage(stage(kind="dpo", zero_stage=3, gradient_checkpointing=True, optimizer_offload=True),
                        shapes.resolve_shape(CODELLAMA_34B), node(mem="256G"))
    assert p.fits is False and p.memory.host_headroom < 0 <= p.memory.gpu_headroom


def test_34b_dpo_flops_are_about_8n_per_token():
    t = dpo_34b().time
    n = shapes.resolve_shape(CODELLAMA_34B).n_params
    assert 8.0 < t.model_flops_per_token / n < 8.6  # 6N policy + 2N reference + attention at 2048
    assert 10.0 < t.flops_per_token / n < 10.8  # checkpointing repeats the policy forward
    assert t.tokens_per_step == 64 * 2 * 2048  # chosen + rejected per row


def test_34b_dpo_speed_is_below_the_a100_peak_rate():
    t = dpo_34b().time
    tokens_per_gpu_s = t.tokens_per_step / t.step_s / 8
    assert tokens_per_gpu_s < 312e12 / (8 * 33.7e9)  # 100% MFU at ~8N: ~1,160 tokens/s/GPU
    assert 0.2 < t.mfu < 0.55  # no better than the best-tuned stacks (LLM Foundry 30B on A100: 55%)


def test_plan_pipeline_reports_the_34b_case_and_refuses_it(tmp_path):
    spec = PipelineSpec.model_validate({
        "name": "llama34b-dpo",
        "cluster": {"executor": "slurm", "gpu": "a100-80gb", "gpus_per_node": 8},
        "defaults": {"precision": "bf16", "zero_stage": 3, "gradient_checkpointing": True,
                     "attention": "flash_attention_2", "max_len": 2048, "micro_batch_size": 1},
        "stages": [{"name": "dpo", "kind": "dpo", "model": CODELLAMA_34B, "global_batch_size": 64,
                    "data": {"path": str(tmp_path / "prefs.jsonl")}}],
    })
    plans = plan.plan_pipeline(spec, rows_by_stage={"dpo": 10_000})
    text = plan.format_plan(plans)
    assert "DOES NOT FIT" in text and "reference: precompute" in text
    assert plans[0].time.total_s == pytest.approx(10_000 / 64 * plans[0].time.step_s, rel=0.02)
    with pytest.raises(DoesNotFit) as err:
        plan.raise_if_not_fits(plans)
    assert err.value.exit_code == EXIT_DOES_NOT_FIT and "dpo" in err.value.message and "short" in err.value.message
    payload = plan.plan_to_json(plans)
    json.dumps(payload)
    assert payload["fits"] is False
    assert payload["stages"][0]["gpu"]["peak_bytes"] == plans[0].memory.gpu_peak
    assert payload["stages"][0]["gpu_name"] == plans[0].hardware.gpu.name  # not overwritten by the memory
    assert payload["stages"][0]["suggestions"][0]["fits"] is True


# --------------------------------------------------------------------------- suggestions


def test_suggestions_for_34b_are_minimal_fitting_and_cheapest_first():
    suggestions = dpo_34b().suggestions
    assert suggestions and all(s.estimate.fits for s in suggestions)
    keys = [(s.changes_training, s.estimate.gpu_seconds_per_1000_rows) for s in suggestions]
    assert keys == sorted(keys)
    changed = [set(s.changes) for s in suggestions]
    assert not any(a < b for a in changed for b in changed)  # no suggestion contains a smaller one
    first = suggestions[0]
    assert not first.changes_training and first.changes.get("reference") in ("precompute", "offload")
    order = [s.description for s in suggestions]
    offload = next(i for i, d in enumerate(order) if d.startswith("optimizer_offload"))
    reference = next(i for i, d in enumerate(order) if d.startswith("reference"))
    assert reference < offload  # CPU Adam every step costs more than moving the reference in


def test_training_preserving_changes_come_before_lora_and_shorter_rows():
    suggestions = dpo_34b().suggestions
    flags = [s.changes_training for s in suggestions]
    assert flags == sorted(flags)
    assert any(s.changes.get("lora_rank") for s in suggestions if s.changes_training)


def test_checkpointing_is_suggested_first_when_activations_overflow():
    mistral = shapes.BUILTIN_SHAPES["mistralai/Mistral-7B-v0.1"]
    p = plan.plan_stage(stage(zero_stage=3, max_len=16384), mistral, node())
    assert p.fits is False  # ~200 KB per token per layer x 32 layers x 16K tokens
    # Keeping only each MLP's input (4 tiles of 4,096 positions rerun in the backward: 73 GiB) and
    # halving each process's tokens (two processes share each sequence) also fit, and cost less than
    # checkpointing's recompute on NVLink: all come before anything that changes the training.
    assert [s.changes for s in p.suggestions[:3]] == [{"mlp_tiles": 4}, {"sequence_parallel": 2},
                                                      {"gradient_checkpointing": True}]
    assert not any(s.changes_training for s in p.suggestions[:3])


def test_more_nodes_than_needed_is_not_suggested():
    nodes = [s.changes["nodes"] for s in dpo_34b().suggestions if "nodes" in s.changes]
    assert nodes == [2]  # 4 nodes also fit, but 2 already do


def test_a_fitting_stage_gets_no_suggestions():
    p = plan.plan_stage(stage(zero_stage=3, gradient_checkpointing=True), LLAMA2_7B, node())
    assert p.fits is True and p.suggestions == []


def test_when_nothing_fits_the_closest_changes_are_offered():
    p = plan.plan_stage(stage(zero_stage=3, gradient_checkpointing=True, max_len=4096),
                        shapes.BUILTIN_SHAPES["meta-llama/Llama-2-70b-hf"], node(gpu="rtx3090", gpus=1))
    assert p.fits is False and p.suggestions
    assert not any(s.estimate.fits for s in p.suggestions)
    assert "closest" in plan.format_plan([p])


# --------------------------------------------------------------- 7B reward model on 6x RTX 4090 (CONTEXT.md question 1)


def rm_4090(**fields):
    spec = dict(kind="rm", zero_stage=3, lora=LoraSpec(rank=64), gradient_checkpointing=True, max_len=8192)
    spec.update(fields)
    return plan.plan_stage(stage(**spec), shapes.BUILTIN_SHAPES["meta-llama/Meta-Llama-3-8B"],
                           node(gpu="rtx4090", gpus=6), rows=550_000)


def test_rm_8192_zero3_lora_fits_in_memory_so_the_problem_is_time():
    p = rm_4090()
    assert p.fits is True  # LoRA + checkpointing + flash: ~18 GiB of 23.6; no vocab logits for a scalar head
    assert p.time.total_s > 7 * 86400  # over a week at max_len: "crawling"


def test_rm_8192_without_checkpointing_or_with_eager_attention_does_not_fit():
    assert rm_4090(gradient_checkpointing=False).fits is False
    assert rm_4090(attention="eager").fits is False


def test_rm_zero2_keeps_the_whole_bf16_base_and_only_fits_at_4096():
    assert rm_4090(zero_stage=2).fits is False  # 15 GB of bf16 weights + 8192-token activations
    short = rm_4090(zero_stage=2, max_len=4096)
    assert 0 < short.memory.gpu_headroom < 3 * GiB  # 21.3 of 23.6 GiB: fits, with little to spare


def test_rm_4096_zero2_is_more_than_twice_as_fast_per_row():
    slow, fast = rm_4090(), rm_4090(zero_stage=2, max_len=4096)
    assert slow.time.seconds_per_1000_rows > 2 * fast.time.seconds_per_1000_rows


def test_zero3_over_pcie_communicates_more_than_over_nvlink():
    shape = shapes.BUILTIN_SHAPES["meta-llama/Meta-Llama-3-8B"]
    spec = stage(kind="rm", zero_stage=3, lora=LoraSpec(rank=64), gradient_checkpointing=True, max_len=1024)
    pcie = plan.plan_stage(spec, shape, node(gpu="rtx4090", gpus=8)).time
    nvlink = plan.plan_stage(spec, shape, node(gpu="a100-80gb", gpus=8)).time
    assert pcie.communication_s > 10 * nvlink.communication_s
    assert pcie.exposed_communication_s > 0 == nvlink.exposed_communication_s


# --------------------------------------------------------------------------- PPO (designed for; CONTEXT.md question 2)


def test_ppo_holds_actor_critic_reference_and_reward_model():
    actor, reward = shapes.BUILTIN_SHAPES["Qwen/Qwen1.5-7B"], shapes.BUILTIN_SHAPES["Qwen/Qwen1.5-1.8B"]
    ppo = plan.PPOWorkload(reward_shape=reward, critic_shape=reward, rollout_rows=64, scoring_batch=4,
                           new_tokens=256, samples_per_prompt=1)
    p = plan.plan_stage(stage(kind="ppo", zero_stage=3, gradient_checkpointing=True, optimizer_offload=True,
                              max_len=1024, reference="offload"), actor, node(gpu="rtx4090", gpus=8), ppo=ppo)
    roles = {i.name.split(" ")[0] for i in p.memory.items}
    assert {"actor", "critic", "reference", "reward"} <= roles
    # 8.8B trained-or-consulted parameters in bf16 is 17.6 GB (CONTEXT.md); trained ones are actor + critic
    assert p.total_params == pytest.approx(actor.n_params * 2 + reward.params_with_head("scalar") * 2, rel=0.001)
    assert p.trained_params == actor.n_params + reward.params_with_head("scalar")
    assert item(p.memory, "KV cache", "generation") == 2 * 32 * 4096 * 2 * 4 * 1024
    assert p.fits is True  # 8x 4090 is enough with ZeRO-3 and offload


def test_ppo_without_a_kl_term_plans_no_reference_model():
    # Llama-2-7B (6,738,415,616 parameters, 131,072,000 of them the input embedding), ZeRO-2 on
    # 8 A100: the reference is a whole bf16 copy on every GPU, 2 bytes x 6,738,415,616 =
    # 13,476,831,232 bytes, and one forward per rollout token: 2 FLOPs per matmul parameter
    # (2 x 6,607,343,616) + attention 4 x 32 layers x 4096 x 1024 positions = 13,751,558,144 FLOPs.
    def rl(**fields):
        stage = {"name": "rl", "kind": "ppo", "model": "meta-llama/Llama-2-7b-hf", "data": {"path": "builtin:digits"},
                 "reward": {"rules": [{"rule": "exact_match"}]}, "max_len": 1024, **fields}
        spec = PipelineSpec.model_validate({"name": "p", "cluster": {"gpu": "a100-80gb", "gpus_per_node": 8},
                                            "stages": [stage]})
        return plan.plan_pipeline(spec)[0]

    with_kl, without = rl(kl_coef=0.05), rl(kl_coef=0.0)
    assert (with_kl.knobs.reference, without.knobs.reference) == ("live", None)
    assert not any(i.name.startswith("reference") for i in without.memory.items)
    assert with_kl.memory.gpu_peak - without.memory.gpu_peak == 2 * 6_738_415_616
    assert with_kl.total_params - without.total_params == 6_738_415_616
    flops = with_kl.time.model_flops_per_token - without.time.model_flops_per_token
    assert flops == 2 * (6_738_415_616 - 131_072_000) + 4 * 32 * 4096 * 1024 == 13_751_558_144
    assert without.time.step_s < with_kl.time.step_s
    assert "reference none (kl_coef 0)" in plan.format_plan([without])
    # Where a reference would wait is moot without one: nothing to suggest about it.
    assert [s.description for s in rl(kl_coef=0.05, reference="offload").without] == ["reference: live"]
    assert rl(kl_coef=0.0, reference="offload").without == []
    # Dynamic sampling's extra rounds depend on the rewards: the plan says its time is for one.
    assert not any("dynamic_sampling" in w for w in with_kl.warnings)
    assert any("at most 5 rounds" in w for w in rl(dynamic_sampling=True, dynamic_sampling_max_rounds=5).warnings)


# --------------------------------------------------------------------------- the pipeline front door


def _spec(cluster, stages=None):
    return PipelineSpec.model_validate({
        "name": "p", "cluster": cluster,
        "stages": stages or [{"name": "sft", "kind": "sft", "model": "builtin:tiny-llama",
                              "data": {"path": "builtin:digits"}}],
    })


def test_unknown_gpu_in_a_pipeline_is_invalid_input():
    with pytest.raises(InvalidInput) as err:
        plan.plan_pipeline(_spec({"gpu": "tpu-v5", "gpus_per_node": 8}))
    assert err.value.exit_code == EXIT_INVALID
    assert "cluster.gpu" in err.value.message and "h100-80gb" in err.value.message


def test_unknown_model_in_a_pipeline_names_the_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    spec = _spec({"gpu": "a100-80gb", "gpus_per_node": 8},
                 [{"name": "sft", "kind": "sft", "model": "nobody/nothing", "data": {"path": "builtin:digits"}}])
    with pytest.raises(InvalidInput) as err:
        plan.plan_pipeline(spec)
    assert "stages[0] (sft).model" in err.value.message


def test_a_from_stage_uses_its_upstream_model():
    spec = _spec({"gpu": "a100-80gb", "gpus_per_node": 8}, [
        {"name": "sft", "kind": "sft", "model": "meta-llama/Llama-2-7b-hf", "data": {"path": "builtin:digits"}},
        {"name": "dpo", "kind": "dpo", "from": "sft", "data": {"path": "builtin:digits"}},
    ])
    plans = plan.plan_pipeline(spec)
    assert plans[1].shape == LLAMA2_7B and plans[1].model == "meta-llama/Llama-2-7b-hf"


def test_the_cpu_pipeline_is_planned_without_a_verdict_or_time():
    plans = plan.plan_pipeline(_spec({"executor": "local", "tasks_per_node": 2}))
    assert plans[0].fits is None and plans[0].time is None and plans[0].world == 2
    assert "not checked" in plan.format_plan(plans)
    plan.raise_if_not_fits(plans)  # nothing known not to fit: no error


def test_time_per_1000_rows_without_a_row_count_and_total_with_one():
    without = plan.plan_stage(stage(zero_stage=3, gradient_checkpointing=True), LLAMA2_7B, node())
    with_rows = plan.plan_stage(stage(zero_stage=3, gradient_checkpointing=True, epochs=2), LLAMA2_7B, node(),
                                rows=8_000)
    assert without.time.total_s is None and "per 1000 rows" in plan.format_plan([without])
    assert with_rows.time.steps == 2 * 8_000 // 8
    assert with_rows.time.total_s == pytest.approx(with_rows.time.steps * with_rows.time.step_s)
    assert with_rows.time.seconds_per_1000_rows == pytest.approx(1000 / 8 * with_rows.time.step_s)


def test_offload_and_checkpointing_cost_time():
    base = plan.plan_stage(stage(zero_stage=3), TINYLLAMA, node()).time
    checkpointed = plan.plan_stage(stage(zero_stage=3, gradient_checkpointing=True), TINYLLAMA, node()).time
    offloaded = plan.plan_stage(stage(zero_stage=3, optimizer_offload=True), TINYLLAMA, node()).time
    assert checkpointed.compute_s == pytest.approx(base.compute_s * 4 / 3, rel=0.05)  # 8N instead of 6N
    assert offloaded.step_s > base.step_s and offloaded.mfu < base.mfu


def test_planner_constants_agree_with_the_deepspeed_config_the_stages_use():
    from stages.engine import deepspeed_config, frozen_model_config

    for on_gpu, bucket in ((True, plan.GPU_BUCKET_ELEMENTS), (False, plan.CPU_BUCKET_ELEMENTS)):
        spec = stage(zero_stage=3, learning_rate=1e-5, betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0)
        zero = deepspeed_config(spec, 8, 4096, on_gpu=on_gpu)["zero_optimization"]
        assert zero["reduce_bucket_size"] == bucket and zero["stage3_prefetch_bucket_size"] == bucket
        assert zero["overlap_comm"] is on_gpu  # two gradient buckets on GPUs
        assert zero["stage3_param_persistence_threshold"] == plan.persistence_threshold(4096)
        assert "sub_group_size" not in zero  # DeepSpeed's default, which SUB_GROUP_SIZE mirrors
        frozen = frozen_model_config(spec, 8, 4096, on_gpu=on_gpu, offload=False)["zero_optimization"]
        assert "stage3_prefetch_bucket_size" not in frozen  # DeepSpeed's default: FROZEN_PREFETCH_ELEMENTS


def test_planner_mirrors_deepspeeds_defaults():
    config = pytest.importorskip("deepspeed.runtime.zero.config")

    defaults = config.DeepSpeedZeroConfig()
    assert defaults.sub_group_size == plan.SUB_GROUP_SIZE
    assert defaults.max_live_parameters == plan.MAX_LIVE_PARAMETERS
    assert defaults.prefetch_bucket_size == plan.FROZEN_PREFETCH_ELEMENTS


def test_a_smaller_micro_batch_keeps_the_global_batch_by_accumulation():
    p = plan.plan_stage(stage(zero_stage=3, gradient_checkpointing=True, micro_batch_size=32, max_len=4096),
                        shapes.BUILTIN_SHAPES["meta-llama/Meta-Llama-3-8B"], node())
    assert p.fits is False  # 32 x 4096 tokens x 128256 vocab: bf16 logits and their gradient alone are 62 GiB
    first = p.suggestions[0]
    assert first.changes == {"micro_batch_size": 16, "global_batch_size": 256} and not first.changes_training


def test_ppo_references_are_never_precomputed():
    knobs = plan.Knobs(kind="ppo", zero_stage=3)
    changes = [c for _, c, _, _ in plan.fixes._candidate_changes(knobs, LLAMA2_7B, node())]
    assert {"reference": "offload"} in changes and {"reference": "precompute"} not in changes


def test_bf16_on_a_v100_is_flagged():
    p = plan.plan_stage(stage(), LLAMA2_7B, node(gpu="v100-32gb"))
    assert any("fp16" in w for w in p.warnings)


@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_pipeline_fits_its_hardware_by_the_plan(path):
    plans = plan_pipeline(load_pipeline(str(path)))
    assert all(plan.fits is not False for plan in plans), format_plan(plans)


def test_the_34b_plan_says_why_offload_is_on_and_that_two_nodes_need_none():
    dpo = plan_pipeline(load_pipeline("llama34b_dpo"))[1]
    assert dpo.fits
    without = {s.description: s.estimate.fits for s in dpo.without}
    assert without["no offload at all (ZeRO-3 alone)"] is False
    assert without["nodes: 2, optimizer_offload: false"] is True
    assert "why these settings" in format_plan([dpo])


# --------------------------------------------------------------------------- checkpoint save time


def test_a_checkpoint_holds_the_trained_models_weights_and_adam_states_not_the_frozen_reference():
    from pipeline.plan.timing import checkpoint_bytes, checkpoint_save_seconds

    shape = shapes.resolve_shape(CODELLAMA_34B)
    n = shape.params_with_head("lm")
    for precision, per_param in (("bf16", 2 + 12), ("fp32", 4 + 8)):  # weights + (master,) m, v
        knobs = plan.Knobs.from_stage(stage(kind="dpo", precision=precision))
        models, _ = plan.stage_models(knobs, shape)
        assert [m.trained for m in models].count(True) == 1  # the reference is not saved
        assert checkpoint_bytes(models, knobs) == n * per_param
    two_nodes = plan.Knobs.from_stage(stage(kind="dpo", nodes=2))
    models, _ = plan.stage_models(two_nodes, shape)
    assert checkpoint_save_seconds(models, two_nodes) == pytest.approx(n * 14 / 2 / 1e9)  # 1 GB/s per node


def test_the_signal_lead_covers_twice_the_save_and_a_step_and_stays_in_slurms_range():
    from pipeline.plan.timing import signal_lead_seconds

    assert signal_lead_seconds(save_s=236.0, step_s=26.0) == 2 * 236 + 2 * 26 + 60
    assert signal_lead_seconds(save_s=0.01, step_s=None) == 90  # a tiny model: the floor
    assert signal_lead_seconds(save_s=5000.0, step_s=10.0) == 3600
