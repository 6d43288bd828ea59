"""Loading a model folder the same way on every supported transformers, and what loading found.

`from_pretrained` applies stages/compat.py's load-time patches first, and returns a LoadReport
beside the model: the weights the model lacked, the folder's weights it had no place for, and
those of another shape, alike on every version. transformers 5 under ZeRO-3 counts no unexpected
weights ("we assume only best-case scenario with deepspeed"): they are counted here with its own
renamings, base-model prefix and ignore patterns. A weight of another shape stops the load where
transformers raises (4.x always, 5.x under ZeRO-3; only rank 0 raises under ZeRO-3): the names are
read from its message. 4.x refuses a folder with no weight name in common with the model as
"corrupted"; that becomes a report too. A damaged weights file raises DamagedWeights whichever
reader found it.

causal_mask_cap (one of compat's patches, switched off by its off switch): transformers
4.38.0-4.38.2 `LlamaModel.__init__` (and Gemma's) registers a bool `causal_mask` buffer of
max_position_embeddings^2 elements, which ZeRO-3 materialises on every GPU for every model (200K
positions: 40 GB). Where the installed model class registers it, models are built with
max_position_embeddings capped at the stage's training length; `exported_config` puts the original
back when the model is saved, so the exported config.json is the model's own.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from stages import compat
from stages.packed_attention import install_packing_hooks

_capped_configs: list[tuple[weakref.ref, dict]] = []


@dataclass
class LoadReport:
    """What transformers found as it loaded a folder's weights into the model its config.json
    describes; transformers' own exceptions (weights it ignores by design, tied weights) left out."""

    model_type: str  # config.json's
    saved_as: str | None  # the class the folder was saved as: config.json's architectures[0], if any
    built_as: str | None = None  # the class built (None: loading stopped at a weight of another shape)
    missing: list[str] = field(default_factory=list)  # the model's weights the folder lacks
    unexpected: list[str] = field(default_factory=list)  # the folder's weights the model has no place for
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)  # name, shape in the folder, in the model
    errors: list[str] = field(default_factory=list)  # what else transformers could not load


class DamagedWeights(OSError):
    """A weights file of the folder would not read: cut short or damaged."""


# torch's words for a weight whose shape differs from the model's, as load_state_dict words them.
_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) "
                            r"from checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")
_NOTHING_IN_COMMON = "state dictionary of the model you are trying to load is corrupted"  # transformers 4.x


def from_pretrained(auto_class, path: str, dtype: torch.dtype, attention: str, max_len: int, **config_overrides):
    """`auto_class.from_pretrained(path)` in `dtype` with `attention`, `config_overrides`
    (e.g. num_labels=1) set on its config, and the load-time patches applied. Returns the model
    (None where transformers stopped at a weight of another shape) and its LoadReport."""
    from safetensors import SafetensorError
    from transformers import AutoConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    compat.prepare()
    kwargs = compat.from_pretrained_kwargs(dtype, attention)
    config = AutoConfig.from_pretrained(path, **config_overrides)
    report = LoadReport(config.model_type, (getattr(config, "architectures", None) or [None])[0])
    capped = _cap_positions(config, path, max_len)
    if capped:
        config_overrides = {"config": config}
    zero3 = is_deepspeed_zero3_enabled()
    try:
        with _counting_unexpected_under_zero3(report) if zero3 else contextlib.nullcontext():
            # Under ZeRO-3, 4.x would compare the folder's shapes with the shards' (empty) ones.
            model, info = auto_class.from_pretrained(path, **kwargs, **config_overrides, output_loading_info=True,
                                                     ignore_mismatched_sizes=not zero3)
    except SafetensorError as err:
        raise DamagedWeights(f"a safetensors file would not read ({err})") from None
    except RuntimeError as err:
        if "PytorchStreamReader" in str(err):  # a torch.save file (transformers 4.x says OSError)
            raise DamagedWeights(f"a torch.save file would not read ({str(err).split('.')[0]})") from None
        report.mismatched = sorted(_SIZE_MISMATCH.findall(str(err)))
        if not report.mismatched:
            raise
        return None, report
    except ValueError as err:
        if _NOTHING_IN_COMMON not in str(err):
            raise
        report.errors.append("the folder holds none of the weights of the model's base (transformers "
                             f"{compat.versions()['transformers']}: {err})")
        return None, report
    report.built_as = type(model).__name__
    report.missing = sorted(set(report.missing) | set(info["missing_keys"]))
    report.unexpected = sorted(set(report.unexpected) | set(info["unexpected_keys"]))
    report.mismatched = sorted((name, str(list(saved)), str(list(built)))
                               for name, saved, built in info["mismatched_keys"])
    report.errors = list(info.get("error_msgs") or [])
    install_packing_hooks(model)
    if capped:
        _capped_configs[:] = [(ref, orig) for ref, orig in _capped_configs if ref() is not None]
        _capped_configs.append((weakref.ref(model.config), capped))
    return model, report


def _cap_positions(config, path: str, max_len: int) -> dict:
    """causal_mask_cap: cap `config`'s max_position_embeddings at the training length where the installed
    model class would register a square causal_mask buffer; the original values it changed."""
    positions = getattr(config, "max_position_embeddings", None)
    switched_off = "causal_mask_cap" in compat.disabled_patches()
    if switched_off or not (positions and positions > max_len and registers_square_causal_mask(config)):
        return {}
    config.max_position_embeddings = max_len
    compat.log_once(f"cap:{path}:{max_len}", "causal_mask_cap: transformers %s would register a %dx%d "
                    "causal_mask buffer in %s; building it with max_position_embeddings=%d (the training "
                    "length); the exported config keeps %d", compat.versions()["transformers"], positions,
                    positions, path, max_len, positions)
    return {"max_position_embeddings": positions}


@contextlib.contextmanager
def _counting_unexpected_under_zero3(report: LoadReport):
    """Count, into `report.unexpected`, the folder's weights transformers 5 loads under ZeRO-3
    without a place in the model (it reports none there)."""
    import transformers.modeling_utils as modeling

    original = getattr(modeling, "_load_state_dict_into_zero3_model", None)
    if original is None or compat.transformers_version().major < 5:
        yield
        return

    def load(model, state_dict, load_config=None):
        names = list(state_dict)
        loaded = original(model, state_dict, load_config)
        report.unexpected = _without_a_place(model, names, getattr(load_config, "weight_mapping", None) or [])
        return loaded

    modeling._load_state_dict_into_zero3_model = load
    try:
        yield
    finally:
        modeling._load_state_dict_into_zero3_model = original


def _without_a_place(model, names: list[str], weight_mapping: list) -> list[str]:
    """The checkpoint names that transformers 5's renamings and base-model prefix place nowhere in
    `model`, less those its ignore patterns leave out (its own rules, as its other loading path)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [m for m in weight_mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in weight_mapping if isinstance(m, WeightConverter)]
    places = dict.fromkeys(model.state_dict(), True)
    unplaced = {name for name in names
                if rename_source_key(name, renamings, converters, base_model_prefix=model.base_model_prefix,
                                     meta_state_dict=places)[0] not in places}
    found = SimpleNamespace(missing_keys=set(), unexpected_keys=unplaced)
    model._adjust_missing_and_unexpected_keys(found)
    return sorted(found.unexpected_keys)


@contextlib.contextmanager
def exported_config(model):
    """While saving `model`: its config holds the values the model had before loading
    capped them (e.g. max_position_embeddings), so the exported config.json is its own."""
    configs = [getattr(model, "config", None)]
    if hasattr(model, "get_base_model"):
        configs.append(getattr(model.get_base_model(), "config", None))
    restored = []
    for ref, originals in _capped_configs:
        config = ref()
        if config is not None and any(config is c for c in configs):
            current = {k: getattr(config, k) for k in originals}
            for key, value in originals.items():
                setattr(config, key, value)
            restored.append((config, current))
    try:
        yield
    finally:
        for config, current in restored:
            for key, value in current.items():
                setattr(config, key, value)


def registers_square_causal_mask(config) -> bool:
    """Whether the base model class for `config` registers a (positions x positions)
    `causal_mask` buffer in its __init__ (transformers 4.38.0-4.38.2: Llama, Gemma)."""
    from transformers import MODEL_MAPPING

    try:
        base = MODEL_MAPPING[type(config)]
        source = inspect.getsource(base.__init__)
    except (KeyError, TypeError, OSError):
        return False
    return "causal_mask" in source and "register_buffer" in source
