"""Model architectures as the planner needs them: sizes, not weights.

A shape comes from a model folder's config.json, the Hugging Face hub cache, or a
built-in table of the models people name most (their published config.json
numbers, see MODELS.md), so `python -m pipeline plan` works on a login node
before anything is downloaded. Pure Python: no torch, no transformers.

Parameter count of a Llama-style decoder (SwiGLU MLP, RMSNorm, RoPE):
  embeddings V*h (+ V*h again for an untied lm_head)
  + layers * [ q: h*H*d, k and v: h*K*d each, o: H*d*h   (H heads, K KV heads, d = head dim)
               + MLP gate/up/down: 3*h*i  + two norms: 2*h  (+ q/k/v biases (H+2K)*d if any) ]
  + final norm h
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

BUILTIN_PREFIX = "builtin:"

# Decoder families by transformers model_type, the one list: `exact` when the formula above
# describes the family (others are estimated with it and flagged), `patched` when stages/compat.py's
# load-time patches (rotary_fp32, logits_native_dtype, flash_varlen) cover its modelling module.
MODEL_FAMILIES = {
    "llama": {"exact": True, "patched": True},
    "mistral": {"exact": True, "patched": True},
    "qwen2": {"exact": True, "patched": True},
    "mixtral": {"exact": False, "patched": True},  # mixture of experts: not the dense formula
    **{t: {"exact": True, "patched": False}
       for t in ("qwen3", "yi", "internlm2", "gemma", "gemma2", "olmo", "olmo2", "granite")},
}
LLAMA_LIKE = {t for t, family in MODEL_FAMILIES.items() if family["exact"]}
PATCHED_FAMILIES = tuple(t for t, family in MODEL_FAMILIES.items() if family["patched"])

# model_types whose q/k/v projections carry a bias
QKV_BIAS_TYPES = {"qwen2"}

# transformers' own defaults for tie_word_embeddings when config.json omits it
UNTIED_BY_DEFAULT = {"llama", "mistral", "qwen2", "qwen3", "yi", "internlm2", "olmo", "olmo2", "mixtral"}


class ShapeNotFound(ValueError):
    """No config.json for the model anywhere the planner may look."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    model_type: str = "llama"
    head_dim_override: Optional[int] = None
    # Not a size (so not part of a shape's equality): kept so a scale model (pipeline/scale.py) has the real one.
    rope_theta: Optional[float] = field(default=None, compare=False)
    source: str = field(default="", compare=False)

    # ------------------------------------------------------------ dimensions

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_llama_like(self) -> bool:
        return self.model_type in LLAMA_LIKE

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by peft module name."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_width),
            "k_proj": (h, self.kv_width),
            "v_proj": (h, self.kv_width),
            "o_proj": (self.q_width, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    # ------------------------------------------------------------ counts

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Extra parameters of the language-model head (none when tied to the embeddings)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def layer_params(self) -> int:
        bias = (self.q_width + 2 * self.kv_width) if self.qkv_bias else 0
        return sum(a * b for a, b in self.linear_dims().values()) + bias + 2 * self.hidden

    @property
    def trunk_params(self) -> int:
        """Embeddings, decoder layers and final norm: everything but the output head."""
        return self.embedding_params + self.layers * self.layer_params + self.hidden

    @property
    def n_params(self) -> int:
        """Parameters of the causal LM (trunk + lm_head)."""
        return self.trunk_params + self.lm_head_params

    def params_with_head(self, head: str) -> int:
        """'lm': next-token head; 'scalar': a reward/value model's Linear(h, 1) instead."""
        return self.n_params if head == "lm" else self.trunk_params + self.hidden

    def parameter_tensors(self, head: str = "lm") -> list[int]:
        """numel of every parameter tensor, in model order (for ZeRO-3 persistence and
        the largest tensor a buffer must hold)."""
        per_layer = [self.hidden]  # input norm
        for name, (a, b) in self.linear_dims().items():
            per_layer.append(a * b)
            if self.qkv_bias and name in ("q_proj", "k_proj", "v_proj"):
                per_layer.append(b)
        per_layer.append(self.hidden)  # post-attention norm
        tensors = [self.embedding_params] + per_layer * self.layers + [self.hidden]
        if head == "lm":
            if not self.tied_embeddings:
                tensors.append(self.vocab * self.hidden)
        else:
            tensors.append(self.hidden)
        return tensors

    def lora_tensors(self, rank: int, targets) -> list[int]:
        """numel of every LoRA adapter tensor (A: r x in, B: out x r) for the target modules."""
        dims = self.linear_dims()
        per_layer: list[int] = []
        extra: list[int] = []
        for target in targets:
            if target in dims:
                a, b = dims[target]
                per_layer += [rank * a, b * rank]
            elif target == "lm_head":
                extra += [rank * self.hidden, self.vocab * rank]
            elif target == "embed_tokens":
                extra += [rank * self.vocab, self.hidden * rank]
            else:
                known = ", ".join(list(dims) + ["lm_head", "embed_tokens"])
                raise ValueError(f"LoRA target module '{target}' is not a layer of a {self.model_type} model; known: {known}")
        return per_layer * self.layers + extra

    def lora_params(self, rank: int, targets) -> int:
        """Trainable adapter parameters: r x (in + out) per targeted linear layer."""
        return sum(self.lora_tensors(rank, targets))

    def describe(self) -> str:
        return (f"{count_text(self.n_params)} params: hidden {self.hidden}, {self.layers} layers, "
                f"{self.heads} heads ({self.kv_heads} KV), vocab {self.vocab}")


def count_text(n: float) -> str:
    """3.37e10 -> '33.7B', 1.2e5 -> '120K'."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


# --------------------------------------------------------------------------- config.json


def _first(config: dict, *keys, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def from_config_json(config: dict, source: str = "") -> ModelShape:
    """A shape from a Hugging Face config.json (already parsed)."""
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "model_type": config.get("model_type")}
    model_type = str(config.get("model_type") or "llama")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head")
    vocab = _first(config, "vocab_size")
    missing = [name for name, value in
               (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads), ("vocab_size", vocab))
               if value is None]
    if missing:
        raise ValueError(f"{source or 'config.json'} has no {', '.join(missing)}; is it a decoder language model?")
    tied_default = model_type not in UNTIED_BY_DEFAULT
    return ModelShape(
        hidden=int(hidden),
        intermediate=int(_first(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * int(hidden))),
        layers=int(layers),
        heads=int(heads),
        kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
        vocab=int(vocab),
        max_positions=int(_first(config, "max_position_embeddings", "n_positions", "max_sequence_length", default=0)),
        tied_embeddings=bool(config.get("tie_word_embeddings", tied_default)),
        qkv_bias=bool(config.get("attention_bias", model_type in QKV_BIAS_TYPES)),
        model_type=model_type,
        head_dim_override=_head_dim_override(config, int(hidden), int(heads)),
        rope_theta=_rope_theta(config),
        source=source,
    )


# The class each model type of the built-in table is built as.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def to_config_json(shape: ModelShape) -> dict:
    """The config.json of a shape from the built-in table (the inverse of from_config_json),
    so a model of that architecture can be built where its own config.json is not at hand."""
    if shape.model_type not in ARCHITECTURES:
        raise ValueError(f"no config.json can be written for model type {shape.model_type}")
    config = {
        "architectures": [ARCHITECTURES[shape.model_type]], "model_type": shape.model_type,
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions, "tie_word_embeddings": shape.tied_embeddings,
    }
    if shape.model_type == "llama":
        config["attention_bias"] = shape.qkv_bias  # qwen2 has its q/k/v biases built in
    if shape.head_dim_override:
        config["head_dim"] = shape.head_dim_override
    if shape.rope_theta is not None:
        config["rope_theta"] = shape.rope_theta
    return config


def _head_dim_override(config: dict, hidden: int, heads: int) -> Optional[int]:
    """config.json's head_dim when it differs from hidden / heads (e.g. Gemma), else None."""
    head_dim = config.get("head_dim")
    return int(head_dim) if head_dim and int(head_dim) != hidden // heads else None


def _rope_theta(config: dict) -> Optional[float]:
    """rope_theta at the top (transformers 4.x) or under rope_parameters (5.x)."""
    theta = config.get("rope_theta")
    if theta is None and isinstance(config.get("rope_parameters"), dict):
        theta = config["rope_parameters"].get("rope_theta")
    return float(theta) if theta is not None else None


def read_config_json(path: Path) -> ModelShape:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return from_config_json(config, source=str(path))


# --------------------------------------------------------------------------- built-in shapes

# From the models' published config.json files (MODELS.md).
_TABLE = {
    "meta-llama/Llama-2-7b-hf": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000, max_positions=4096, rope_theta=1e4),
    "meta-llama/Llama-2-13b-hf": dict(hidden=5120, intermediate=13824, layers=40, heads=40, kv_heads=40, vocab=32000, max_positions=4096, rope_theta=1e4),
    "meta-llama/Llama-2-70b-hf": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000, max_positions=4096, rope_theta=1e4),
    "codellama/CodeLlama-34b-hf": dict(hidden=8192, intermediate=22016, layers=48, heads=64, kv_heads=8, vocab=32000, max_positions=16384, rope_theta=1e6),
    "01-ai/Yi-34B": dict(hidden=7168, intermediate=20480, layers=60, heads=56, kv_heads=8, vocab=64000, max_positions=4096, rope_theta=5e6),
    "01-ai/Yi-34B-200K": dict(hidden=7168, intermediate=20480, layers=60, heads=56, kv_heads=8, vocab=64000, max_positions=200000, rope_theta=1e7),
    "meta-llama/Meta-Llama-3-8B": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, max_positions=8192, rope_theta=5e5),
    "meta-llama/Meta-Llama-3-70B": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256, max_positions=8192, rope_theta=5e5),
    "mistralai/Mistral-7B-v0.1": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=32000, max_positions=32768, model_type="mistral", rope_theta=1e4),
    "Qwen/Qwen1.5-7B": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=151936, max_positions=32768, model_type="qwen2", qkv_bias=True, rope_theta=1e6),
    "Qwen/Qwen1.5-1.8B": dict(hidden=2048, intermediate=5504, layers=24, heads=16, kv_heads=16, vocab=151936, max_positions=32768, model_type="qwen2", qkv_bias=True, rope_theta=1e6),
}
BUILTIN_SHAPES: dict[str, ModelShape] = {
    hub_id: ModelShape(**dims, source=f"built-in table ({hub_id})") for hub_id, dims in _TABLE.items()
}


def tiny_llama_shape() -> ModelShape:
    """builtin:tiny-llama, as core/tiny.py writes it (read from its constants; no torch)."""
    from core import tiny  # torch-free at module level; torch is imported inside its writers

    return ModelShape(
        hidden=64, intermediate=176, layers=2, heads=2, kv_heads=2,
        vocab=len(tiny.SPECIAL_TOKENS) + len(tiny.CHARACTERS), max_positions=64,
        tied_embeddings=False, source="builtin:tiny-llama",
    )


# --------------------------------------------------------------------------- resolving a name


def cached_config(hub_id: str, hub_cache: Optional[Path]) -> Optional[Path]:
    """config.json of a hub model in the hub cache (the snapshot refs/main names, else the newest)."""
    if hub_cache is None or hub_id.count("/") != 1:
        return None
    repo = Path(hub_cache) / ("models--" + hub_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip() / "config.json"
        if candidate.is_file():
            return candidate
    configs = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return configs[0] if configs else None


def _builtin_lookup(model: str) -> Optional[ModelShape]:
    lowered = {k.lower(): v for k, v in BUILTIN_SHAPES.items()}
    return lowered.get(model.lower())


def resolve_shape(model: str, hub_cache: Optional[Path] = None) -> ModelShape:
    """The shape of what a stage's `model:` names: builtin:NAME, a local folder, a hub id
    in the hub cache (pipeline/hfcache.py says where; None: none is looked at), or a hub id
    in the built-in table (in that order)."""
    if model.startswith(BUILTIN_PREFIX):
        if model == BUILTIN_PREFIX + "tiny-llama":
            return tiny_llama_shape()
        raise ShapeNotFound(f"no built-in model '{model}'")
    path = Path(model).expanduser()
    if path.exists():
        return _shape_of_folder(path, model, hub_cache)
    cached = cached_config(model, hub_cache)
    if cached is not None:
        return read_config_json(cached)
    builtin = _builtin_lookup(model)
    if builtin is not None:
        return builtin
    raise ShapeNotFound(
        f"cannot tell the size of model '{model}': it is not a local folder, not in the Hugging Face "
        f"cache ({hub_cache}), and not one of the built-in shapes ({', '.join(BUILTIN_SHAPES)}). "
        f"Download its config first (huggingface-cli download {model} config.json) or give a local "
        "folder holding its config.json."
    )


def _shape_of_folder(path: Path, name: str, hub_cache: Optional[Path]) -> ModelShape:
    if path.is_file():
        return read_config_json(path)
    config = path / "config.json"
    if config.is_file():
        return read_config_json(config)
    adapter = path / "adapter_config.json"
    if adapter.is_file():  # a peft adapter folder: the shape is its base model's
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{adapter}: not readable JSON ({err})") from None
        if base:
            return replace(resolve_shape(base, hub_cache), source=f"{adapter} -> {base}")
    raise ShapeNotFound(f"{name} has no config.json; expected a model folder in Hugging Face format")
