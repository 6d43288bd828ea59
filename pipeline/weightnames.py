"""Whether a model folder's weights are the ones its config.json describes, told from the names
and shapes in their safetensors headers (pipeline/modelfiles.py reads them; nothing is loaded),
so `validate` refuses on a login node a folder that would train from random numbers. Torch-free.

The rule is kept small: it knows how two families name their weights, the Llama-style decoders
of core/shapes.py (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ...) and GPT-2
(`transformer.wte`, `transformer.h.N.attn.c_attn`, ...), the config most often found beside
weights it does not belong to. For a config.json of one of them it checks that
- the weights are named as that family names them (a known family's names otherwise say whose);
- the token embedding is vocab x hidden, there is one decoder layer per layer the config gives,
  and the first layer's attention weights have the widths its heads, KV heads and head_dim give.
A config of another family, weights in torch.save files, a quantized model: nothing is said here;
the stage's own check (stages/loaded_weights.py) finds the rest when it loads the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.shapes import ModelShape, from_config_json


@dataclass(frozen=True)
class Naming:
    family: str
    prefix: str  # what a causal LM puts before its base model's names (a saved base model has none)
    embedding: str
    layer: str  # one weight of each decoder layer, N its number
    layers_key: str  # config.json's count of decoder layers
    shapes: Callable[[ModelShape], dict[str, tuple[list[int], str]]]  # name: shape, config.json's fields for it

    def names(self, tensors: dict) -> dict[str, str]:
        """The names of `tensors` as the base model gives them (the prefix taken off): the folder's names."""
        return {name.removeprefix(self.prefix): name for name in tensors}

    def layer_numbers(self, names) -> list[int]:
        pattern = re.compile(re.escape(self.layer).replace("N", r"(\d+)", 1))
        return sorted({int(m.group(1)) for m in map(pattern.fullmatch, names) if m})


LLAMA_STYLE = Naming(
    "Llama-style", "model.", "embed_tokens.weight", "layers.N.self_attn.q_proj.weight", "num_hidden_layers",
    lambda s: {"embed_tokens.weight": ([s.vocab, s.hidden], "vocab_size, hidden_size"),
               "layers.0.self_attn.q_proj.weight": ([s.q_width, s.hidden],
                                                    "num_attention_heads, head_dim, hidden_size"),
               "layers.0.self_attn.k_proj.weight": ([s.kv_width, s.hidden],
                                                    "num_key_value_heads, head_dim, hidden_size")})
GPT2 = Naming(
    "GPT-2", "transformer.", "wte.weight", "h.N.attn.c_attn.weight", "n_layer",
    lambda s: {"wte.weight": ([s.vocab, s.hidden], "vocab_size, n_embd"),
               "h.0.attn.c_attn.weight": ([s.hidden, 3 * s.hidden], "n_embd")})
# By config.json's model_type: the decoder families of core/shapes.py that name their weights as
# Llama does (internlm2, remote code, names its own), and GPT-2.
NAMINGS = {**dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2",
                            "granite"), LLAMA_STYLE), "gpt2": GPT2}


def mismatch(config: dict, tensors: dict[str, tuple[list[int], Path]]) -> str | None:
    """What in `tensors` (name: shape, file) config.json (parsed) contradicts; None when nothing,
    or when it cannot tell."""
    naming = NAMINGS.get(config.get("model_type") or "")
    if naming is None or config.get("quantization_config") or not tensors:
        return None
    try:
        shape = from_config_json(config)
    except ValueError:
        return None
    own = naming.names(tensors)
    if naming.embedding not in own:
        return _other_names(config["model_type"], naming, tensors)
    layers = naming.layer_numbers(own)
    if layers != list(range(shape.layers)):
        held = f"{layers[0]}-{layers[-1]}" if layers == list(range(len(layers))) else ", ".join(map(str, layers))
        return (f"config.json's {naming.layers_key} is {shape.layers}, but the weights hold {len(layers)} decoder "
                f"layers ({naming.prefix}{naming.layer} for N in {held or 'none'})")
    for name, (expected, fields) in naming.shapes(shape).items():
        if name in own and tensors[own[name]][0] != expected:
            held_shape, file = tensors[own[name]]
            return f"{own[name]} in {file.name} is {held_shape}, but config.json's {fields} make it {expected}"
    return None


def _other_names(model_type: str, naming: Naming, tensors: dict) -> str:
    theirs = next((other for other in set(NAMINGS.values()) if other is not naming
                   and other.embedding in other.names(tensors)), None)
    said = (f"config.json's model_type is {model_type}, whose weights are named as {naming.family} models name "
            f"theirs ({naming.prefix}{naming.embedding}, {naming.prefix}{naming.layer}, ...)")
    if theirs is not None:
        return (f"{said}, but the weights are named as {theirs.family} models name theirs "
                f"({theirs.prefix}{theirs.embedding}, {theirs.prefix}{theirs.layer}, ...): config.json belongs to "
                "another model")
    return f"{said}, but no weight has that name (the weights' names: {', '.join(sorted(tensors)[:3])}, ...)"
