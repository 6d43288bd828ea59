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
What a family holds besides (more norms, q/k norms, biases, attention sinks; DeepSeek's latent
attention) is core/families.py's. A mixture-of-experts layer holds, in place of the MLP, a
router E*h and E experts of 3*h*i_e each (+ shared experts): memory counts all E, FLOPs the k
experts each token goes through (experts_per_token) and the router.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path

from core import published_shapes as published
from core.families import (
    FAMILIES,
    PATCHED_FAMILIES,  # noqa: F401  (stages/compat.py reads it from here)
    Family,
    LatentAttention,
    biases,
    expert_fields,
    family,
    latent_attention,
    uncountable,
)

BUILTIN_PREFIX = "builtin:"

COUNTED_FAMILIES = tuple(t for t, f in FAMILIES.items() if f.counted)


class ShapeNotFound(ValueError):
    """No config.json for the model anywhere the planner may look."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int  # the dense MLP's width (mixtral, gpt_oss: each expert's)
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    model_type: str = "llama"
    head_dim_override: int | None = None
    o_bias: bool = False
    mlp_bias: bool = False
    # mixture of experts: routed experts per expert layer (0: dense), how many each token goes
    # through, each one's width, the shared experts' width, and the layers that stay dense
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    dense_layers: tuple = ()
    latent: LatentAttention | None = None
    # Not a size (so not part of a shape's equality): kept so a scale model (pipeline/scale.py) has the real one.
    rope_theta: float | None = field(default=None, compare=False)
    source: str = field(default="", compare=False)

    # ------------------------------------------------------------ family

    @property
    def family(self) -> Family:
        return family(self.model_type)

    @property
    def is_counted(self) -> bool:
        """Its family's count is checked against transformers' own (core/families.py); else estimated."""
        return self.family.counted

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def expert_layer(self, index: int) -> bool:
        return self.is_moe and index not in self.dense_layers

    @cached_property
    def expert_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.expert_layer(i))

    def _layer_kinds(self) -> list[int]:
        """One decoder layer of each kind (dense, expert): the others repeat them."""
        first = {self.expert_layer(i): i for i in reversed(range(self.layers))}
        return sorted(first.values())

    # ------------------------------------------------------------ dimensions

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        return self.heads * (self.latent.qk_head if self.latent else self.head_dim)

    @property
    def kv_width(self) -> int:
        """Keys' width per position (latent attention: one per query head)."""
        return self.heads * self.latent.qk_head if self.latent else self.kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        return self.heads * self.latent.v_head if self.latent else self.kv_width

    @property
    def out_width(self) -> int:
        """The attention's output per position, o_proj's input."""
        return self.heads * self.latent.v_head if self.latent else self.q_width

    @property
    def attention_io_width(self) -> int:
        """q, k, v and the output per position: what the attention keeps and Ulysses exchanges."""
        return self.q_width + self.kv_width + self.v_width + self.out_width

    @cached_property
    def mlp_width(self) -> int:
        """The MLP intermediate one token goes through (an expert layer: its k experts' and the
        shared ones'), the widest layer's."""
        return max(self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate
                   if self.expert_layer(i) else self.intermediate for i in self._layer_kinds())

    def attention_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of a decoder layer's attention projections, by peft module name."""
        h, lat = self.hidden, self.latent
        if lat is None:
            return {"q_proj": (h, self.q_width), "k_proj": (h, self.kv_width), "v_proj": (h, self.kv_width),
                    "o_proj": (self.q_width, h)}
        q = ({"q_a_proj": (h, lat.q_rank), "q_b_proj": (lat.q_rank, self.q_width)} if lat.q_rank
             else {"q_proj": (h, self.q_width)})
        return {**q, "kv_a_proj_with_mqa": (h, lat.kv_rank + lat.qk_rope),
                "kv_b_proj": (lat.kv_rank, self.heads * (lat.qk_nope + lat.v_head)), "o_proj": (self.out_width, h)}

    def _mlp_linears(self, width: int) -> dict[str, tuple[int, int]]:
        h = self.hidden
        return {"gate_proj": (h, width), "up_proj": (h, width), "down_proj": (width, h)}

    def layer_linears(self, index: int) -> dict[str, tuple[int, int]]:
        """The Linear modules of decoder layer `index`, by the names peft's target_modules match:
        the attention's, and the MLP's (a dense layer) or the shared experts' (an expert layer;
        routed experts are 3-d parameters in transformers 5, no Linear of their own)."""
        linears = self.attention_linears()
        if not self.expert_layer(index):
            linears.update(self._mlp_linears(self.intermediate))
        elif self.shared_expert_intermediate:
            linears.update(self._mlp_linears(self.shared_expert_intermediate))
            if self.family.shared_expert == "qwen2":
                linears["shared_expert_gate"] = (self.hidden, 1)
        return linears

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of the products one decoder layer multiplies, by peft module name:
        its attention and a dense MLP, or one expert (the shapes a matmul rate is measured at)."""
        width = self.expert_intermediate if self.is_moe and not self.dense_layers else self.intermediate
        return {**self.attention_linears(), **self._mlp_linears(width)}

    # ------------------------------------------------------------ counts

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Extra parameters of the language-model head (none when tied to the embeddings)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def _attention_tensors(self) -> list[int]:
        fam, lat = self.family, self.latent
        tensors: list[int] = []
        for name, (a, b) in self.attention_linears().items():
            tensors.append(a * b)
            if name in ("q_proj", "k_proj", "v_proj") and self.qkv_bias and lat is None:
                tensors.append(b)
            elif name in ("q_a_proj", "kv_a_proj_with_mqa") and self.qkv_bias:
                tensors.append(b)
            elif name == "o_proj" and self.o_bias:
                tensors.append(b)
            if name == "q_a_proj":
                assert lat is not None  # the low-rank projections are latent attention's
                tensors.append(lat.q_rank)  # q_a_layernorm
            elif name == "kv_a_proj_with_mqa":
                assert lat is not None
                tensors.append(lat.kv_rank)  # kv_a_layernorm
        if fam.qk_norm == "head":
            tensors += [self.head_dim, self.head_dim]
        elif fam.qk_norm == "width":
            tensors += [self.q_width, self.kv_width]
        if fam.sinks:
            tensors.append(self.heads)
        return tensors

    def _mlp_tensors(self, width: int, biased: bool) -> list[int]:
        h = self.hidden
        return [h * width, h * width, width * h] + ([width, width, h] if biased else [])

    @property
    def expert_params(self) -> int:
        """One routed expert's parameters (gate, up, down; gpt_oss: their biases)."""
        i, h = self.expert_intermediate, self.hidden
        return 3 * h * i + (2 * i + h if self.family.expert_biases else 0)

    def _expert_layer_tensors(self) -> list[int]:
        fam, h, e, i = self.family, self.hidden, self.experts, self.expert_intermediate
        tensors = [e * h] + ([e] if fam.expert_biases else [])  # the router
        tensors += [e * 2 * i * h, e * i * h]  # gate and up fused, down: transformers 5's layout
        if fam.expert_biases:
            tensors += [e * 2 * i, e * h]
        if self.shared_expert_intermediate:
            tensors += self._mlp_tensors(self.shared_expert_intermediate, self.mlp_bias)
            if fam.shared_expert == "qwen2":
                tensors.append(h)  # shared_expert_gate
        return tensors

    def layer_tensors(self, index: int) -> list[int]:
        """numel of every parameter tensor of decoder layer `index` (weights, biases, norms)."""
        norms = [self.hidden] * self.family.layer_norms if self.family.norm_weights else []
        mlp = (self._expert_layer_tensors() if self.expert_layer(index)
               else self._mlp_tensors(self.intermediate, self.mlp_bias))
        return norms[:1] + self._attention_tensors() + mlp + norms[1:]

    @cached_property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (what ZeRO-3 gathers at once)."""
        return max(sum(self.layer_tensors(i)) for i in self._layer_kinds())

    @cached_property
    def decoder_params(self) -> int:
        """Parameters of all decoder layers."""
        return sum(sum(self.layer_tensors(i)) for i in range(self.layers))

    @property
    def final_norm_params(self) -> int:
        return self.hidden if self.family.norm_weights else 0

    @cached_property
    def trunk_params(self) -> int:
        """Embeddings, decoder layers and final norm: everything but the output head."""
        return self.embedding_params + self.decoder_params + self.final_norm_params

    @cached_property
    def n_params(self) -> int:
        """Parameters of the causal LM (trunk + lm_head)."""
        return self.trunk_params + self.lm_head_params

    def params_with_head(self, head: str) -> int:
        """'lm': next-token head; 'scalar': a reward/value model's Linear(h, 1) instead."""
        return self.n_params if head == "lm" else self.trunk_params + self.hidden

    @cached_property
    def inactive_expert_params(self) -> int:
        """Parameters of the routed experts a token does not go through, over all layers."""
        return self.expert_layers * max(0, self.experts - self.experts_per_token) * self.expert_params

    def active_params_with_head(self, head: str) -> int:
        """The parameters one token's forward multiplies by (all of them in a dense model)."""
        return self.params_with_head(head) - self.inactive_expert_params

    @cached_property
    def mlp_active_params(self) -> int:
        """The MLPs' matmul parameters one token goes through, over all layers (router included)."""
        h, total = self.hidden, 0
        for i in range(self.layers):
            if self.expert_layer(i):
                total += h * self.experts + 3 * h * (self.experts_per_token * self.expert_intermediate
                                                     + self.shared_expert_intermediate)
            else:
                total += 3 * h * self.intermediate
        return total

    def parameter_tensors(self, head: str = "lm") -> list[int]:
        """numel of every parameter tensor, in model order (for ZeRO-3 persistence and
        the largest tensor a buffer must hold)."""
        return list(_parameter_tensors(self, head))

    def _parameter_tensors(self, head: str) -> tuple[int, ...]:
        tensors = [self.embedding_params]
        for i in range(self.layers):
            tensors += self.layer_tensors(i)
        tensors += [self.hidden] if self.family.norm_weights else []
        if head == "lm":
            if not self.tied_embeddings:
                tensors.append(self.vocab * self.hidden)
        else:
            tensors.append(self.hidden)
        return tuple(tensors)

    def _adapted(self, targets) -> tuple[tuple[tuple[int, int], ...], ...]:
        """(in, out) of each adapted Linear, per decoder layer. As peft, a target some layer lacks
        adapts nothing there (an expert model's gate_proj); ValueError when no target is anywhere."""
        return _adapted_linears(self, tuple(targets))

    def _find_adapted(self, targets: tuple) -> tuple[tuple[tuple[int, int], ...], ...]:
        per_layer = tuple(tuple(linears[t] for t in targets if t in linears)
                          for linears in (self.layer_linears(i) for i in range(self.layers)))
        names = set().union(*(self.layer_linears(i) for i in self._layer_kinds())) | {"lm_head", "embed_tokens"}
        if not names.intersection(targets):
            raise ValueError(f"LoRA target modules {', '.join(targets)}: none is a layer of a {self.model_type} "
                             f"model; known: {', '.join(sorted(names))}")
        return per_layer

    def lora_tensors(self, rank: int, targets) -> list[int]:
        """numel of every LoRA adapter tensor (A: r x in, B: out x r) for the target modules."""
        return list(_lora_tensors(self, rank, tuple(targets)))

    def _find_lora_tensors(self, rank: int, targets: tuple) -> tuple[int, ...]:
        tensors = [n for layer in self._adapted(targets) for a, b in layer for n in (rank * a, b * rank)]
        for target in targets:
            if target == "lm_head":
                tensors += [rank * self.hidden, self.vocab * rank]
            elif target == "embed_tokens":
                tensors += [rank * self.vocab, self.hidden * rank]
        return tuple(tensors)

    def trained_tensors(self, head: str, lora_rank: int | None = None, lora_targets=()) -> list[int]:
        """numel of every tensor a stage trains of this model: all of them, or with LoRA its adapters
        (and a reward or value model's scalar head, which peft trains in full: modules_to_save)."""
        if not lora_rank:
            return self.parameter_tensors(head)
        return self.lora_tensors(lora_rank, lora_targets) + ([self.hidden] if head == "scalar" else [])

    def lora_params(self, rank: int, targets) -> int:
        """Trainable adapter parameters: r x (in + out) per targeted linear layer."""
        return sum(self.lora_tensors(rank, targets))

    def lora_layer_params(self, rank: int, targets) -> int:
        """Adapter parameters of the decoder layer that has the most."""
        return max((rank * sum(a + b for a, b in layer) for layer in self._adapted(targets)), default=0)

    def lora_features(self, targets) -> int:
        """In + out features of every adapted Linear of the decoder layers (not the head's)."""
        return _lora_features(self, tuple(targets))

    def describe(self) -> str:
        experts = ""
        if self.is_moe:
            active = count_text(self.active_params_with_head("lm"))
            experts = f", {self.experts} experts ({self.experts_per_token} per token: {active} active)"
        return (f"{count_text(self.n_params)} params: hidden {self.hidden}, {self.layers} layers, "
                f"{self.heads} heads ({self.kv_heads} KV), vocab {self.vocab}{experts}")


# The planner asks for a shape's tensors and LoRA adapters thousands of times while it searches for fixes.
@lru_cache(maxsize=64)
def _parameter_tensors(shape: ModelShape, head: str) -> tuple[int, ...]:
    return shape._parameter_tensors(head)


@lru_cache(maxsize=64)
def _adapted_linears(shape: ModelShape, targets: tuple) -> tuple[tuple[tuple[int, int], ...], ...]:
    return shape._find_adapted(targets)


@lru_cache(maxsize=64)
def _lora_tensors(shape: ModelShape, rank: int, targets: tuple) -> tuple[int, ...]:
    return shape._find_lora_tensors(rank, targets)


@lru_cache(maxsize=64)
def _lora_features(shape: ModelShape, targets: tuple) -> int:
    return sum(a + b for layer in shape._adapted(targets) for a, b in layer)


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
    """A shape from a Hugging Face config.json (already parsed). ValueError for one that is not a
    decoder, or of a family the planner cannot count (core/families.py uncountable)."""
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "model_type": config.get("model_type")}
    model_type = str(config.get("model_type") or "llama")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head")
    vocab = _first(config, "vocab_size")
    missing = [name for name, value in
               (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                ("vocab_size", vocab))
               if value is None]
    if missing:
        raise ValueError(f"{source or 'config.json'} has no {', '.join(missing)}; is it a decoder language model?")
    refused = uncountable(config, model_type)
    if refused:
        raise ValueError(f"{source or 'config.json'}: {refused}")
    fam = family(model_type)
    intermediate = int(_first(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * int(hidden)))
    qkv_bias, o_bias = biases(config, fam)
    latent = latent_attention(config) if fam.latent_attention else None
    return ModelShape(
        hidden=int(hidden),
        intermediate=intermediate,
        layers=int(layers),
        heads=int(heads),
        kv_heads=int(heads) if latent else int(_first(config, "num_key_value_heads", default=heads)),
        vocab=int(vocab),
        max_positions=int(_first(config, "max_position_embeddings", "n_positions", "max_sequence_length", default=0)),
        tied_embeddings=bool(config.get("tie_word_embeddings", not fam.untied)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=fam.mlp_bias and bool(config.get("mlp_bias")),
        model_type=model_type,
        head_dim_override=None if latent else _head_dim_override(config, int(hidden), int(heads)),
        latent=latent,
        rope_theta=_rope_theta(config),
        source=source,
        **expert_fields(config, fam, int(layers), intermediate),
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


def builtin_config(hub_id: str) -> dict | None:
    """The config.json of a hub id of the built-in table: as published (the experts'), or written
    from its shape (to_config_json); None for a hub id not in the table."""
    shape = _builtin_lookup(hub_id)
    if shape is None:
        return None
    config = {k.lower(): v for k, v in published.EXPERTS.items()}.get(hub_id.lower())
    return dict(config) if config else to_config_json(shape)


def _head_dim_override(config: dict, hidden: int, heads: int) -> int | None:
    """config.json's head_dim when it differs from hidden / heads (e.g. Gemma), else None."""
    head_dim = config.get("head_dim")
    return int(head_dim) if head_dim and int(head_dim) != hidden // heads else None


def _rope_theta(config: dict) -> float | None:
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

BUILTIN_SHAPES: dict[str, ModelShape] = {
    **{hub_id: ModelShape(**dims, source=f"built-in table ({hub_id})") for hub_id, dims in published.DENSE.items()},
    **{hub_id: from_config_json(config, source=f"built-in table ({hub_id})")
       for hub_id, config in published.EXPERTS.items()},
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


def cached_config(hub_id: str, hub_cache: Path | None) -> Path | None:
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


def _builtin_lookup(model: str) -> ModelShape | None:
    lowered = {k.lower(): v for k, v in BUILTIN_SHAPES.items()}
    return lowered.get(model.lower())


def resolve_shape(model: str, hub_cache: Path | None = None) -> ModelShape:
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


def _shape_of_folder(path: Path, name: str, hub_cache: Path | None) -> ModelShape:
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
