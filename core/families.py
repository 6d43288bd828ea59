"""The decoder families the planner knows, by transformers model_type: what each holds per layer
beyond the Llama layout (norms, biases, attention sinks, experts, latent attention), read from
config.json. Pure Python (no torch): core/shapes.py counts with it on login nodes.

`counted`: tests/test_shape_families.py builds a tiny model of the family with the installed
transformers and the planner's count equals its parameters'. The others (no transformers class
to build: remote code, or a hub name for a Llama) are estimated with the same layout and the
plan says so. A model_type not listed is estimated as a Llama-style decoder, unless its
config.json describes experts or latent attention, which the Llama layout cannot count: that is
refused (`uncountable`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Family:
    counted: bool  # checked against transformers' own model of the family (see the module doc)
    patched: bool = False  # stages/compat.py's load-time patches cover its modelling module
    layer_norms: int = 2  # hidden-sized norm weights per decoder layer (gemma2: 4; olmo2: 2, after)
    qk_norm: str = ""  # "head": q_norm and k_norm over one head; "width": over the q and kv widths
    norm_weights: bool = True  # olmo's LayerNorms have no parameters (nor has its final norm)
    bias: str = "attention_bias"  # what config.json key biases the attention projections (see below)
    bias_default: bool = False  # transformers' default for that key when config.json omits it
    mlp_bias: bool = False  # honours config.json's mlp_bias
    untied: bool = True  # transformers' default when config.json has no tie_word_embeddings (its base: tied)
    sinks: bool = False  # gpt_oss: one learned attention sink per head
    experts: str = ""  # how its layers hold experts: "" (dense), "all", "sparse_step", "first_dense"
    shared_expert: str = ""  # "deepseek": moe_intermediate x n_shared_experts; "qwen2": its own width + a gate
    expert_biases: bool = False  # gpt_oss: the router and the experts' projections have biases
    latent_attention: bool = False  # DeepSeek's multi-head latent attention (MLA)
    # (kernel, the first transformers version that refuses it; "" every one) its model classes refuse:
    # _supports_sdpa / _supports_flash_attn false, or flash_attention_2 not among its
    # _compatible_flash_implementations (gpt_oss's sinks need kernels from the hub);
    # tests/test_attention_support.py checks them against the installed transformers
    refuses: tuple = ()


# bias: "attention_bias" biases q, k, v and o when config.json's attention_bias is true;
# "qkv": q, k, v always (qwen2); "qkv_bias": q, k, v when config.json's qkv_bias is (qwen2_moe);
# "": none (mistral, mixtral).
FAMILIES: dict[str, Family] = {
    "llama": Family(counted=True, patched=True, mlp_bias=True),
    "mistral": Family(counted=True, patched=True, bias=""),
    "qwen2": Family(counted=True, patched=True, bias="qkv"),
    "mixtral": Family(counted=True, patched=True, bias="", experts="all"),
    "qwen3": Family(counted=True, qk_norm="head"),
    "gemma": Family(counted=True, untied=False),
    "gemma2": Family(counted=True, untied=False, layer_norms=4, refuses=(("sdpa", "5.21"),)),
    "gemma3_text": Family(counted=True, untied=False, layer_norms=4, qk_norm="head"),
    "olmo": Family(counted=True, layer_norms=0, norm_weights=False),
    "olmo2": Family(counted=True, qk_norm="width"),
    "granite": Family(counted=True, mlp_bias=True),
    "qwen3_moe": Family(counted=True, qk_norm="head", experts="sparse_step"),
    "qwen2_moe": Family(counted=True, bias="qkv_bias", bias_default=True, experts="sparse_step",
                        shared_expert="qwen2"),
    "gpt_oss": Family(counted=True, bias_default=True, sinks=True, experts="all", expert_biases=True,
                      refuses=(("sdpa", ""), ("flash_attention_2", ""))),
    "deepseek_v2": Family(counted=True, mlp_bias=True, experts="first_dense", shared_expert="deepseek",
                          latent_attention=True),
    "deepseek_v3": Family(counted=True, experts="first_dense", shared_expert="deepseek", latent_attention=True),
    # No transformers class to build and compare: Yi's own config.json says llama today; InternLM2
    # is remote code (wqkv fused, w1/w2/w3), the Llama layout in other names.
    "yi": Family(counted=False),
    "internlm2": Family(counted=False, bias="bias"),
}
PATCHED_FAMILIES = tuple(t for t, family in FAMILIES.items() if family.patched)
# The Llama layout with nothing else, for a model_type not listed.
LLAMA_LAYOUT = Family(counted=False, untied=False)

# config.json keys that say a layer holds experts or latent attention, whatever the family calls them.
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
LATENT_KEYS = ("kv_lora_rank",)


def family(model_type: str) -> Family:
    return FAMILIES.get(model_type, LLAMA_LAYOUT)


def uncountable(config: dict, model_type: str) -> str | None:
    """Why the planner cannot count a model of an unlisted model_type (None: it can, as a Llama)."""
    if model_type in FAMILIES:
        return None
    experts = next((key for key in EXPERT_KEYS if config.get(key)), None)
    what = ("a mixture of experts (config.json's " + experts + ")" if experts else
            "latent attention (config.json's kv_lora_rank)" if any(config.get(k) for k in LATENT_KEYS) else None)
    if what is None:
        return None
    known = ", ".join(t for t, f in FAMILIES.items() if f.experts or f.latent_attention)
    return (f"model_type '{model_type}' is {what}, which the planner cannot count as a dense Llama-style decoder; "
            f"the families it counts with experts: {known}")


def _count(config: dict, *keys, default=0) -> int:
    for key in keys:
        if config.get(key) is not None:
            return int(config[key])
    return default


def expert_fields(config: dict, fam: Family, layers: int, intermediate: int) -> dict:
    """ModelShape's expert fields from config.json (none for a dense family)."""
    if not fam.experts:
        return {}
    experts = _count(config, *EXPERT_KEYS)
    dense: tuple[int, ...]
    if fam.experts == "all":
        dense = ()
    elif fam.experts == "first_dense":
        dense = tuple(range(min(layers, _count(config, "first_k_dense_replace"))))
    else:  # qwen: mlp_only_layers and every decoder_sparse_step-th layer
        step = _count(config, "decoder_sparse_step", default=1)
        only = set(config.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step)
    expert_width = _count(config, "moe_intermediate_size", default=intermediate)
    if fam.shared_expert == "deepseek":
        shared = expert_width * _count(config, "n_shared_experts")
    elif fam.shared_expert == "qwen2":
        shared = _count(config, "shared_expert_intermediate_size")
    else:
        shared = 0
    return dict(experts=experts, experts_per_token=_count(config, "num_experts_per_tok"),
                expert_intermediate=expert_width, shared_expert_intermediate=shared, dense_layers=dense)


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention: q (and k, v) go through low-rank projections."""

    q_rank: int  # q_lora_rank; 0: q is one projection
    kv_rank: int
    qk_nope: int  # per-head q/k dimensions without and with rotary embeddings
    qk_rope: int
    v_head: int

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope


def latent_attention(config: dict) -> LatentAttention:
    return LatentAttention(q_rank=_count(config, "q_lora_rank"), kv_rank=_count(config, "kv_lora_rank"),
                           qk_nope=_count(config, "qk_nope_head_dim"), qk_rope=_count(config, "qk_rope_head_dim"),
                           v_head=_count(config, "v_head_dim"))


def biases(config: dict, fam: Family) -> tuple[bool, bool]:
    """(q/k/v biased, o biased) as the family builds them from config.json."""
    if fam.bias == "qkv":
        return True, False
    if fam.bias == "qkv_bias":
        return bool(config.get("qkv_bias", fam.bias_default)), False
    if fam.bias in ("attention_bias", "bias"):
        on = bool(config.get(fam.bias, fam.bias_default))
        return on, on
    return False, False


# --------------------------------------------------------------------------- attention

# The kernels a stage's `attention` names, fastest first.
KERNELS = ("flash_attention_2", "sdpa", "eager")


@functools.cache
def installed_transformers() -> str | None:
    """The version of the transformers installed beside this python, read without importing it
    (once: reading a package's metadata parses its METADATA file, and the planner asks for every
    candidate layout it weighs)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def refused_kernels(model_type: str, transformers_version: str | None) -> set:
    """The kernels the model classes of this family refuse in that transformers version (None: a
    version not known here, so every kernel any supported version refuses)."""
    return {kernel for kernel, since in family(model_type).refuses
            if transformers_version is None or not since or _release(transformers_version) >= _release(since)}


def attention_kernel(requested: str, model_type: str, on_gpu: bool, flash_installed: bool = True,
                     transformers_version: str | None = None) -> str:
    """The attention a model of this family runs: an explicit kernel as asked (validate has refused
    one the family refuses: attention_refusal); auto the fastest it supports where it runs:
    flash_attention_2 on GPUs where flash_attn is installed (the images install it), else sdpa,
    else eager. The planner (on a login node, for the GPUs) and the stage (where it runs) both ask
    this, of the transformers installed with them (installed_transformers)."""
    if requested != "auto":
        return requested
    refused = refused_kernels(model_type, transformers_version)
    usable = [k for k in KERNELS if k not in refused and (k != "flash_attention_2" or (on_gpu and flash_installed))]
    return usable[0]


def attention_refusal(requested: str, model_type: str, transformers_version: str | None) -> str | None:
    """Why a model of this family cannot run the kernel asked for in that transformers version
    (None: it can, or auto)."""
    refused = refused_kernels(model_type, transformers_version)
    if requested == "auto" or requested not in refused:
        return None
    usable = [k for k in KERNELS if k not in refused]
    gpu, cpu = (attention_kernel("auto", model_type, on_gpu, transformers_version=transformers_version)
                for on_gpu in (True, False))
    version = f"transformers {transformers_version}" if transformers_version else "transformers"
    return (f"{version} refuses {requested} for model_type '{model_type}' (its model class does not support "
            f"it): use auto ({gpu} on GPUs, {cpu} on CPU for this family) or {' or '.join(usable)}")
