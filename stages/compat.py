"""Every difference between the supported transformers / DeepSpeed versions, in one place.

Supported stacks: the pinned one (transformers 4.38.2, DeepSpeed 0.13.2, peft 0.10), the
current one (transformers 5.x, DeepSpeed 0.19), and transformers 4.37.2 for loading.
Nothing else in the project asks which version is installed: it calls this module.

Load-time patches. `prepare()` applies them (stages/models.py calls it before it builds a
model); each one applies only where the installed versions need it and logs once what it did.

- rotary_fp32: rotary embeddings keep their frequencies and cos/sin in fp32.
  `deepspeed.zero.Init` replaces torch's tensor constructors with ones that round every
  floating result to the training dtype, so on transformers 4.37 the cos/sin caches are
  built from bf16 positions (cos off by up to 2 at position 4096); and DeepSpeed 0.13's
  engine casts every buffer to bf16 with the parameters, so on 4.38 `inv_freq` loses
  precision (cos off by up to 0.71 at position 4096). The patch builds rotary modules
  with the real constructors and fp32 as the default dtype, and lets later dtype casts of
  the model move those fp32 buffers between devices without converting them. The forward
  pass is left alone, whatever its signature: 4.37 `(x, seq_len)`, 4.38 `(x, position_ids,
  seq_len=None)`, 5.x `(x, position_ids)`; `rotary_cos_sin` reads the signature to call it.
  Not applied where transformers re-initialises the frequencies after construction and
  DeepSpeed casts only parameters (transformers 5.x with DeepSpeed 0.19).
- causal_mask_cap: transformers 4.38.0-4.38.2 `LlamaModel.__init__` (and Gemma's)
  registers a bool `causal_mask` buffer of max_position_embeddings^2 elements, which
  ZeRO-3 materialises on every GPU for every model (200K positions: 40 GB). Where the
  installed model class registers it, models are built with max_position_embeddings capped
  at the stage's training length; `exported_config` puts the original back when the model
  is saved, so the exported config.json is the model's own.
- logits_native_dtype: causal LMs of transformers before 4.45 (4.38: Llama, Mistral, Mixtral,
  Qwen2) upcast all logits to fp32 in their forward, a (tokens x vocab) fp32 copy per micro
  batch; the stages' passes (no cache, no labels) get logits in the model's dtype instead,
  and stages/losses.py reads log-probs from them in fp32 chunk by chunk.
- flash_varlen: flash attention in transformers before 4.44 reads no packed sequences from
  position ids; `_flash_attention_forward` is patched to call flash_attn_varlen_func with
  the boundaries of the packed batch that `sequences_apart` names.

Packed batches (stages/data.py): `install_packing_hooks`, called for every model
`from_pretrained` loads, lets each attention layer keep packed sequences apart inside
`sequences_apart`: eager and sdpa layers get a block-diagonal causal mask (an additive 4D
mask is what attention layers take on every supported version, below each model's own mask
preparation, which differs between versions and model families), flash attention the
sequence boundaries.

What loading found (`from_pretrained` returns a LoadReport beside the model): the weights the
model lacked, the folder's weights it had no place for, and those of another shape, alike on every
version. transformers 5 under ZeRO-3 counts no unexpected weights ("we assume only best-case
scenario with deepspeed"): they are counted here with its own renamings, base-model prefix and
ignore patterns. A weight of another shape stops the load where transformers raises (4.x always,
5.x under ZeRO-3; only rank 0 raises under ZeRO-3): the names are read from its message. 4.x
refuses a folder with no weight name in common with the model as "corrupted"; that becomes a
report too. A damaged weights file raises DamagedWeights whichever reader found it.

Off switch: POST_TRAIN_COMPAT_OFF=rotary_fp32,causal_mask_cap,... (or "all") leaves the named
patches out; the tests use it to show each patch is needed.

DeepSpeed's op builds: `normalize_arch_list_env()` rewrites TORCH_CUDA_ARCH_LIST into the
entries DeepSpeed's op builder can read (9.0a -> 9.0; stages/distributed.py calls it before
DeepSpeed starts).

Spellings that differ (no patching): `dtype` vs `torch_dtype` in `from_pretrained`, torch's
flat-tensor collectives (`tensor_collectives`: `*_single` from torch 2.13; stages/calibrate.py),
HfDeepSpeedConfig's import path, what `apply_chat_template(tokenize=True)` returns, and
which attention implementation names exist (eager, sdpa, flash_attention_2 everywhere), and
whether continuous batching exists (`continuous_batching_available`: 5.x; under ZeRO-3 it also needs
DeepSpeed to lift its hooks, `zero3_unhooked`; stages/generation.py).

Letting go of a ZeRO-3 engine (`destroy_zero3_engine`; a DPO reference freed after its
log-probs are precomputed): every supported DeepSpeed keeps the engine's model reachable from
its module globals after `destroy` (the forward-module stack; a class-wide cache of what each
submodule releases; 0.13 also its module-name map, which `destroy` clears); it takes it out.

`python -m stages.compat --self-check` reports the installed versions and which patches
apply; which DeepSpeed ops are prebuilt (compiled in at install) or already JIT-built in
the extensions folder (stages/deepspeed_ops.py), which optimizer a GPU stage gets and whether it needs a build, and
the TORCH_CUDA_ARCH_LIST rewrite stage jobs would make. It then loads a tiny Llama in bf16
under ZeRO-3 (real DeepSpeed in a one-process group; where DeepSpeed cannot start, e.g.
DeepSpeed 0.13 without a GPU, zero.Init-style constructors and the cast the installed
DeepSpeed does) and checks that its rotary cos/sin match an fp32 build. Exit code 0 when
they do.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import re
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch

from core.shapes import PATCHED_FAMILIES

log = logging.getLogger("stages")

OFF_SWITCH = "POST_TRAIN_COMPAT_OFF"
PATCHES = ("rotary_fp32", "causal_mask_cap", "flash_varlen", "logits_native_dtype")

# The modelling modules of the families the load-time patches cover (core/shapes.py's list).
_MODEL_MODULES = tuple(f"transformers.models.{t}.modeling_{t}" for t in PATCHED_FAMILIES)
# The constructors zero.Init intercepts (DeepSpeed 0.13 to 0.19).
_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")

_logged: set[str] = set()
_applied: dict[str, list] = {}  # patch name -> [(owner, attribute, previous value or _ABSENT)]
_ABSENT = object()
_capped_configs: list[tuple[weakref.ref, dict]] = []


def _log_once(key: str, message: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.info("compat: " + message, *args)


# --------------------------------------------------------------------------- versions


def versions() -> dict[str, str]:
    """Installed versions of the packages whose differences this module covers."""
    from importlib import metadata

    out = {"torch": torch.__version__}
    for name in ("transformers", "deepspeed", "peft", "accelerate", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _transformers_version():
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__)


def disabled_patches() -> set[str]:
    """Patches switched off through POST_TRAIN_COMPAT_OFF."""
    names = {n.strip() for n in os.environ.get(OFF_SWITCH, "").split(",") if n.strip()}
    if "all" in names:
        return set(PATCHES)
    unknown = names - set(PATCHES)
    if unknown:
        raise ValueError(f"{OFF_SWITCH}: unknown patch {sorted(unknown)}; known: {', '.join(PATCHES)}")
    return names


# --------------------------------------------------------------------------- spellings


def from_pretrained_kwargs(dtype: torch.dtype, attention: str) -> dict:
    """Keyword arguments for `from_pretrained` that load in `dtype` with `attention`.

    transformers renamed torch_dtype to dtype in 4.56: older versions take an unknown
    `dtype` for a config field and silently build the model in fp32.
    """
    from packaging.version import Version

    known = attention_implementations()
    if attention not in known:
        raise ValueError(f"attention '{attention}' is not one transformers {versions()['transformers']} "
                         f"knows: {', '.join(known)}")
    dtype_key = "dtype" if _transformers_version() >= Version("4.56") else "torch_dtype"
    return {dtype_key: dtype, "attn_implementation": attention}


def attention_implementations() -> list[str]:
    """Attention implementation names the installed transformers accepts. eager, sdpa and
    flash_attention_2 mean the same on every supported version; 5.x adds more (flex, fa3)."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # before the attention registry (4.48): a fixed set
        return ["eager", "sdpa", "flash_attention_2"]
    return ["eager", *sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())]


def continuous_batching_available(model, zero_stage: int) -> bool:
    """Can `model` generate with transformers' continuous batching (a paged KV cache that requests join
    and leave as they finish: `init_continuous_batching`, transformers 5.x), under this ZeRO stage?
    Asked of the installed classes, not the version number: the pinned stack (transformers 4.38,
    DeepSpeed 0.13) has neither the method nor `zero3_unhooked`'s helper."""
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return False
    has_method = callable(getattr(model, "init_continuous_batching", None))
    return has_method and (zero_stage != 3 or zero3_hooks_liftable())


# Why the pinned stack decodes padded chunks with `generate` rather than on a static cache.
NO_STATIC_DECODING = ("transformers {version}'s StaticCache needs its batch size and device up front, and its Llama "
                      "builds a (batch, 1, max_positions, max_positions) mask per forward and reads "
                      "`torch.any(attention_mask != 1)` on the host at every step: a static-cache step would still "
                      "sync and gain nothing; padded chunks use `generate` there")


def static_decoding_unavailable() -> Optional[str]:
    """Why stages/generation.py cannot decode on a static KV cache here (None: it can). Asked of
    the installed StaticCache, not the version: transformers 5.x's (`StaticCache(config,
    max_cache_len)`) sizes itself at its first update and keeps its fill level in a device tensor,
    so a decode step takes fixed shapes and needs nothing back from the device."""
    try:
        from transformers import StaticCache
    except ImportError:
        return NO_STATIC_DECODING.format(version=versions()["transformers"])
    if "max_batch_size" in inspect.signature(StaticCache.__init__).parameters:
        return NO_STATIC_DECODING.format(version=versions()["transformers"])
    return None


def static_kv_cache(module, max_cache_len: int):
    """A static KV cache of `max_cache_len` positions for `module` (where static_decoding_unavailable is None)."""
    from transformers import StaticCache

    return StaticCache(config=module.config, max_cache_len=max_cache_len)


def enable_checkpointing(model) -> None:
    """Gradient (activation) checkpointing on `model`, non-reentrant. transformers 5.x calls it
    activation_checkpointing_enable and warns on every call of the old name, which 4.x has alone."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def zero3_unhooked(engine):
    """Context: a ZeRO-3 engine's parameters gathered and its per-module forward hooks lifted until
    exit. Inside `GatheredParameters` alone those hooks still release and fetch parameters with
    collective calls on every forward; `generate` keeps processes in step (transformers syncs them
    under ZeRO-3), but continuous batching runs as many forwards as its own requests need, a
    different number on each process, and the mismatched collectives abort (gloo: "Received data
    size doesn't match expected size"). DeepSpeed's own `unwrap_model_for_generation` does this."""
    helper = _unhook_helper()
    if helper is None:
        raise RuntimeError(f"DeepSpeed {versions()['deepspeed']} cannot lift its ZeRO-3 hooks for generation")
    return helper(engine)


def zero3_hooks_liftable() -> bool:
    """Can `zero3_unhooked` lift the installed DeepSpeed's hooks (0.13 cannot)?"""
    return _unhook_helper() is not None


def destroy_zero3_engine(engine) -> None:
    """Let go of everything DeepSpeed holds of a ZeRO-3 engine's model, so that dropping the
    engine frees its weights. `destroy` lifts its hooks and clears the module-name map; no version
    takes the model off the forward-module stack, where every ZeRO-3 engine puts it for good, nor
    empties the cache of what each submodule releases, which holds every submodule (and its
    parameter coordinator) from the first traced forward pass on."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    engine.destroy()
    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [module for module in stack if module is not engine.module]
    # An lru_cache inside DeepSpeed's NVTX wrapper, which keeps no __wrapped__: found in its closure.
    method = vars(PartitionedParameterCoordinator)["_PartitionedParameterCoordinator__params_to_release"]
    for function in [method, *(cell.cell_contents for cell in method.__closure__ or ())]:
        if hasattr(function, "cache_clear"):
            function.cache_clear()  # every engine's entries: a live one just computes its own again


def _unhook_helper():
    try:
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
    except ImportError:
        return None
    return unwrap_model_for_generation


def hf_deepspeed_config(ds_config: dict):
    """transformers' HfDeepSpeedConfig for `ds_config`: while it is alive, from_pretrained
    builds ZeRO-3 models already sharded (transformers.deepspeed before 4.33)."""
    try:
        from transformers.integrations.deepspeed import HfDeepSpeedConfig
    except ImportError:
        from transformers.deepspeed import HfDeepSpeedConfig
    return HfDeepSpeedConfig(ds_config)


def chat_template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of a chat: transformers 5 returns a BatchEncoding, 4.x a list of ids."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --------------------------------------------------------------------------- loading


def prepare() -> None:
    """Apply the load-time patches the installed versions need (once; later calls are free)."""
    off = disabled_patches()
    for name in PATCHES:
        if name in off:
            _log_once(f"off:{name}", "%s switched off (%s)", name, OFF_SWITCH)
            _revert(name)
    if "rotary_fp32" not in off and "rotary_fp32" not in _applied:
        needed, reason = rotary_patch_needed()
        if needed:
            classes = _apply_rotary_fp32()
            _log_once("rotary_fp32", "rotary_fp32 applied (%s): %s", reason,
                      ", ".join(f"{c.__name__}{rotary_signature(c)}" for c in classes))
        else:
            _applied["rotary_fp32"] = []  # decided: nothing to change
            _log_once("rotary_fp32", "rotary_fp32 not needed: %s", reason)
    if "logits_native_dtype" not in off and "logits_native_dtype" not in _applied:
        classes = _apply_native_logits()
        if classes:
            _log_once("logits_native_dtype", "logits_native_dtype applied (transformers %s returns fp32 logits): %s",
                      versions()["transformers"], ", ".join(c.__name__ for c in classes))
    if "flash_varlen" not in off and "flash_varlen" not in _applied:
        if _flash_varlen_patch_needed():
            classes = _apply_flash_varlen()
            _log_once("flash_varlen", "flash_varlen applied (transformers %s reads no packed sequences from "
                      "positions): %s", versions()["transformers"], ", ".join(c.__name__ for c in classes))
        else:
            _applied["flash_varlen"] = []


@dataclass
class LoadReport:
    """What transformers found as it loaded a folder's weights into the model its config.json
    describes; transformers' own exceptions (weights it ignores by design, tied weights) left out."""

    model_type: str  # config.json's
    saved_as: Optional[str]  # the class the folder was saved as: config.json's architectures[0], if any
    built_as: Optional[str] = None  # the class built (None: loading stopped at a weight of another shape)
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

    prepare()
    kwargs = from_pretrained_kwargs(dtype, attention)
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
                             f"{versions()['transformers']}: {err})")
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
    if "causal_mask_cap" in disabled_patches() or not (positions and positions > max_len
                                                        and registers_square_causal_mask(config)):
        return {}
    config.max_position_embeddings = max_len
    _log_once(f"cap:{path}:{max_len}", "causal_mask_cap: transformers %s would register a %dx%d "
              "causal_mask buffer in %s; building it with max_position_embeddings=%d (the training "
              "length); the exported config keeps %d", versions()["transformers"], positions, positions,
              path, max_len, positions)
    return {"max_position_embeddings": positions}


@contextlib.contextmanager
def _counting_unexpected_under_zero3(report: LoadReport):
    """Count, into `report.unexpected`, the folder's weights transformers 5 loads under ZeRO-3
    without a place in the model (it reports none there)."""
    import transformers.modeling_utils as modeling

    original = getattr(modeling, "_load_state_dict_into_zero3_model", None)
    if original is None or _transformers_version().major < 5:
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


# --------------------------------------------------------------------------- rotary


def rotary_patch_needed() -> tuple[bool, str]:
    """(needed, why): whether rotary state can leave fp32 on the installed versions."""
    from transformers import PreTrainedModel

    try:
        reinitialised = "inv_freq" in inspect.getsource(PreTrainedModel._init_weights)
    except (OSError, TypeError):
        reinitialised = False
    reasons = []
    if not reinitialised:
        reasons.append(f"transformers {versions()['transformers']} keeps the rotary state zero.Init built")
    elif not _keeps_rotary_buffers_fp32_under_zero_init():
        reasons.append(f"transformers {versions()['transformers']} re-initialises rotary frequencies into buffers "
                       f"zero.Init built in the training dtype")
    if deepspeed_casts_buffers():
        reasons.append(f"DeepSpeed {versions()['deepspeed']} casts buffers to the training dtype")
    if reasons:
        return True, "; ".join(reasons)
    return False, (f"transformers {versions()['transformers']} re-initialises rotary frequencies after "
                   f"construction and DeepSpeed {versions()['deepspeed']} keeps fp32 buffers")


def _keeps_rotary_buffers_fp32_under_zero_init() -> bool:
    """Whether transformers stops zero.Init from building the rotary buffers in the training dtype
    (its `prevent_arange_dtype_change` around zero.Init; absent in 5.19, whose re-initialised
    frequencies then land in bf16 buffers: wrong positions, as the self-check measures)."""
    try:
        from transformers.integrations.deepspeed import prevent_arange_dtype_change  # noqa: F401
    except ImportError:
        return False
    return True


def deepspeed_casts_buffers() -> bool:
    """Whether the DeepSpeed engine casts buffers with the parameters to bf16/fp16
    (DeepSpeed 0.19 casts parameters only and keeps fp32 buffers)."""
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:
        return False
    return not hasattr(DeepSpeedEngine, "_cast_module_mixed_precision")


def rotary_classes() -> list[type]:
    """The installed rotary embedding classes of the model families listed above."""
    return [cls for _, cls in _model_classes()
            if issubclass(cls, torch.nn.Module) and cls.__name__.endswith("RotaryEmbedding")]


def _model_classes():
    """(module, class) for every class the installed model modules of _MODEL_MODULES define."""
    for module_name in _MODEL_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module_name:
                yield module, value


def rotary_signature(cls) -> str:
    """The forward signature of a rotary class, without self: '(x, seq_len=None)', ..."""
    signature = inspect.signature(cls.forward)
    params = [p for name, p in signature.parameters.items() if name != "self"]
    return str(signature.replace(parameters=params))


def rotary_cos_sin(module, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) in fp32 for positions 0..positions-1 from a rotary module, called with
    the arguments its forward takes: position_ids (4.38 and later) or seq_len (4.37)."""
    parameters = inspect.signature(type(module).forward).parameters
    device = next((b.device for b in module.buffers()), torch.device("cpu"))
    head_dim = _rotary_dim(module)
    x = torch.zeros(1, 1, positions, head_dim, device=device)
    if "position_ids" in parameters:
        cos, sin = module(x, torch.arange(positions, device=device)[None])
    elif "seq_len" in parameters:
        cos, sin = module(x, seq_len=positions)
    else:
        raise TypeError(f"{type(module).__name__}.forward{rotary_signature(type(module))}: neither position_ids "
                        "nor seq_len; stages/compat.py does not know how to call it")
    return cos.reshape(positions, -1).float(), sin.reshape(positions, -1).float()


def _rotary_dim(module) -> int:
    inv_freq = getattr(module, "inv_freq", None)
    if inv_freq is not None:
        return 2 * inv_freq.shape[-1]
    return int(module.dim)


def _apply_rotary_fp32() -> list[type]:
    classes = rotary_classes()
    changes = []
    for cls in classes:
        if "__init__" in vars(cls):
            changes.append((cls, "__init__", vars(cls)["__init__"]))
            cls.__init__ = _built_in_fp32(vars(cls)["__init__"])
        if not any(issubclass(cls, other) and cls is not other for other in classes):
            changes.append((cls, "_apply", vars(cls).get("_apply", _ABSENT)))
            cls._apply = _fp32_buffers_follow_devices_only
    _applied["rotary_fp32"] = changes
    return classes


def _revert(name: str) -> None:
    for owner, attribute, previous in reversed(_applied.pop(name, [])):
        if previous is _ABSENT:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, previous)


def _built_in_fp32(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        with exact_tensor_constructors():
            init(self, *args, **kwargs)

    __init__._compat_original = init
    return __init__


@contextlib.contextmanager
def exact_tensor_constructors():
    """Inside zero.Init, torch's tensor constructors round every floating result to the
    training dtype. In here the real constructors are back, still putting new tensors on
    the device the intercepting ones would have used, with fp32 as the default dtype."""
    device = torch.empty(0).device
    replaced = {}
    for name in _CONSTRUCTORS:
        current, real = getattr(torch, name), getattr(torch._C._VariableFunctions, name, None)
        if real is not None and current is not real:
            replaced[name] = current
            setattr(torch, name, _on_device(real, device))
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(default_dtype)
        for name, function in replaced.items():
            setattr(torch, name, function)


def _on_device(constructor, device):
    @functools.wraps(constructor)
    def construct(*args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = device
        return constructor(*args, **kwargs)

    return construct


def _fp32_buffers_follow_devices_only(self, fn, *args, **kwargs):
    """Module._apply for rotary modules: parameters and other buffers as usual; fp32
    buffers go where `fn` sends them (.to(device), .cuda()) but keep fp32
    (.bfloat16(), .half(), .to(dtype) leave them alone)."""
    kept = {n: b for n, b in self._buffers.items() if b is not None and b.dtype == torch.float32}
    for name in kept:
        self._buffers[name] = None
    try:
        result = torch.nn.Module._apply(self, fn, *args, **kwargs)
    except BaseException:
        self._buffers.update(kept)
        raise
    for name, buffer in kept.items():
        target = fn(buffer).device
        self._buffers[name] = buffer if target == buffer.device else buffer.to(target)
    return result


# --------------------------------------------------------------------------- packed sequences


class PackedSequences:
    """Which sequence each position of a packed batch holds: (lines, width), -1 on padding.

    While a training or scoring pass of a packed batch runs (`sequences_apart`), every
    attention layer of a model loaded through `from_pretrained` sees only its own
    sequence: eager and sdpa layers get a block-diagonal causal mask in place of the
    one the model built (a 4D additive mask is what their attention takes on every
    supported version, below the model's own mask preparation, which differs); flash
    attention layers get the sequences' boundaries (transformers 5 reads them from the
    position ids of a single flat line; on 4.38 `_flash_attention_forward` is patched
    to call flash_attn_varlen_func)."""

    def __init__(self, sequence: torch.Tensor):
        self.sequence = sequence
        self._masks: dict = {}

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(lines, 1, width, width): 0 where a query may look (its own sequence, not ahead),
        the dtype's minimum elsewhere. Padding positions see only each other."""
        if dtype not in self._masks:
            seq = self.sequence
            width = seq.shape[1]
            causal = torch.ones(width, width, dtype=torch.bool, device=seq.device).tril()
            allowed = (seq[:, :, None] == seq[:, None, :]) & causal
            mask = torch.zeros(allowed.shape, dtype=dtype, device=seq.device)
            self._masks[dtype] = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
        return self._masks[dtype]

    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """(cumulative sequence starts, longest sequence) of a single flat line, for varlen kernels."""
        if self.sequence.shape[0] != 1:
            raise ValueError("varlen attention needs the packed sequences on one line")
        seq = self.sequence[0]
        starts = torch.nonzero(torch.diff(seq, prepend=seq[:1] - 1) != 0).flatten()
        bounds = torch.cat([starts, torch.tensor([seq.numel()], device=seq.device)]).to(torch.int32)
        return bounds, int(torch.diff(bounds).max())


# The packed batch being trained on, if any. A plain module global, not a ContextVar or a
# thread-local: on a GPU, autograd runs backward (and gradient checkpointing's recompute of
# the forward) on its own device thread, which must see the same batch. A stage process
# trains on one batch at a time.
_packed: Optional[PackedSequences] = None


@contextlib.contextmanager
def sequences_apart(sequence: Optional[torch.Tensor]):
    """Keep the packed sequences of a batch apart in every attention layer, for a
    forward pass and its backward (gradient checkpointing recomputes the forward
    inside backward, so the backward must run in here too). None: nothing to do."""
    global _packed
    outer, _packed = _packed, (PackedSequences(sequence) if sequence is not None else None)
    try:
        yield
    finally:
        _packed = outer


def flat_packing(attention: str) -> bool:
    """Whether packed sequences go on one flat line (varlen kernels) rather than on
    several lines with a block-diagonal mask."""
    return attention.startswith("flash_attention")


def _attention_layer(module) -> bool:
    return type(module).__name__.endswith(("Attention", "Attention2")) and hasattr(module, "o_proj")


def _keep_sequences_apart(module, args, kwargs):
    packed = _packed
    if packed is None:
        return None
    attention = getattr(getattr(module, "config", None), "_attn_implementation", "") or type(module).__name__
    if "flash" in attention.lower():
        return None  # positions (5.x) or the patched _flash_attention_forward (4.38) do it
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    kwargs["attention_mask"] = packed.additive_mask(hidden.dtype)
    return args, kwargs


def install_packing_hooks(model) -> int:
    """Make every attention layer of `model` honour `sequences_apart`; returns how many."""
    count = 0
    for module in model.modules():
        if _attention_layer(module) and not getattr(module, "_packing_hook", False):
            module.register_forward_pre_hook(_keep_sequences_apart, with_kwargs=True)
            module._packing_hook = True
            count += 1
    return count


def _flash_varlen_patch_needed() -> bool:
    """transformers before 4.44 cannot read packed sequences from position ids in flash attention."""
    try:
        from transformers.modeling_flash_attention_utils import _flash_attention_forward
    except ImportError:
        return True
    return "position_ids" not in inspect.signature(_flash_attention_forward).parameters


def _apply_flash_varlen() -> list:
    changes = []
    for module, cls in _model_classes():
        if "_flash_attention_forward" in vars(cls):
            original = vars(cls)["_flash_attention_forward"]
            changes.append((cls, "_flash_attention_forward", original))
            cls._flash_attention_forward = _varlen_when_packed(original, module)
    _applied["flash_varlen"] = changes
    return [c[0] for c in changes]


def _varlen_when_packed(original, module):
    @functools.wraps(original)
    def _flash_attention_forward(self, query, key, value, attention_mask, query_length, dropout=0.0,
                                 softmax_scale=None, *args, **kwargs):
        packed = _packed
        if packed is None or attention_mask is not None:
            return original(self, query, key, value, attention_mask, query_length, dropout, softmax_scale,
                            *args, **kwargs)
        bounds, longest = packed.cu_seqlens()
        out = module.flash_attn_varlen_func(
            query[0], key[0], value[0], cu_seqlens_q=bounds, cu_seqlens_k=bounds, max_seqlen_q=longest,
            max_seqlen_k=longest, dropout_p=dropout, softmax_scale=softmax_scale, causal=True)
        return out.unsqueeze(0)

    return _flash_attention_forward


# --------------------------------------------------------------------------- logits


def _apply_native_logits() -> list:
    """Causal LMs of transformers before 4.45 upcast every logit to fp32 in their forward: with
    a 128K vocabulary that is a (tokens x vocab) fp32 copy, and its fp32 gradient, per micro
    batch. The stages' loss reads log-probs chunk by chunk in fp32 itself (stages/losses.py),
    so their training and scoring passes (no cache, no labels) keep the model's dtype."""
    changes = []
    for _, cls in _model_classes():
        if (cls.__name__.endswith("ForCausalLM") and "forward" in vars(cls)
                and "logits = logits.float()" in inspect.getsource(cls.forward)):
            changes.append((cls, "forward", vars(cls)["forward"]))
            cls.forward = _logits_in_model_dtype(vars(cls)["forward"])
    _applied["logits_native_dtype"] = changes
    return [c[0] for c in changes]


def _logits_in_model_dtype(original):
    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
        asked = {k for k, v in kwargs.items() if v is not None}  # peft passes labels=None, return_dict=None, ...
        if use_cache is not False or asked or getattr(self.config, "pretraining_tp", 1) > 1:
            return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=use_cache, **kwargs)  # generation, labels: transformers' own
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)[0]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden))

    return forward


# --------------------------------------------------------------------------- processes


def remove_cpu_comm_buffer() -> None:
    """Unlink this rank's /dev/shm buffer of DeepSpeed's CPU shared-memory allreduce.

    DeepSpeed 0.19 creates deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (~70 MB
    of RAM) at init_distributed on CPU and never unlinks it, so every CPU process leaves
    one behind. Call it when this process is done communicating; ranks that still map
    the buffer keep it until they exit."""
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{os.environ.get('RANK', '0')}")
    with contextlib.suppress(OSError):
        os.unlink(name)


# --------------------------------------------------------------------------- DeepSpeed ops

ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
# MAJOR.MINOR, an optional arch-specific / family suffix (9.0a, 10.0f), an optional +PTX.
_ARCH_ENTRY = re.compile(r"^(\d+)\.(\d+)[a-z]?(\+PTX)?$", re.IGNORECASE)


def deepspeed_arch_list(value: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builders read it: MAJOR.MINOR[+PTX] entries
    separated by `;`. None (unset) and blank values are returned as they are.

    torch accepts NVIDIA's arch-specific and family suffixes (9.0a, 10.0f); DeepSpeed 0.19's
    builder fails on them ("invalid literal for int() with base 10: '0a'"), so they lose the
    suffix (sm_90 code runs on the GPUs sm_90a code is for). Spaces become `;` (NGC
    images write "8.0 8.6 9.0+PTX"), duplicates go. Entries DeepSpeed cannot read at all
    (torch's named arches such as Hopper, `native`) are left out; with none left the result
    is None, and DeepSpeed compiles for the GPUs it sees. DeepSpeed 0.13 reads the variable
    only when ops are built at install time; its JIT builds use the visible GPUs."""
    if value is None or not value.strip():
        return value
    kept: list[str] = []
    for entry in re.split(r"[;\s]+", value.strip()):
        match = _ARCH_ENTRY.match(entry)
        if match:
            major, minor, ptx = match.groups()
            readable = f"{major}.{minor}{'+PTX' if ptx else ''}"
            if readable not in kept:
                kept.append(readable)
    return ";".join(kept) or None


def normalize_arch_list_env() -> None:
    """Rewrite this process's TORCH_CUDA_ARCH_LIST so DeepSpeed can build an op with it (call
    it before DeepSpeed builds anything); logs once what it changed."""
    before = os.environ.get(ARCH_LIST)
    after = deepspeed_arch_list(before)
    if after == before:
        return
    if after is None:
        del os.environ[ARCH_LIST]
    else:
        os.environ[ARCH_LIST] = after
    _log_once("arch_list", "%s=%r rewritten to %s: DeepSpeed's op builder reads only MAJOR.MINOR[+PTX] entries",
              ARCH_LIST, before, repr(after) if after is not None else "unset (DeepSpeed builds for the GPUs it sees)")


def tensor_collectives():
    """torch.distributed's all-gather into one flat tensor and reduce-scatter out of one, as
    (all_gather, reduce_scatter), each called (output, input): `*_single` from torch 2.13, where
    the older `all_gather_into_tensor` / `reduce_scatter_tensor` names warn; those before."""
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single, dist.reduce_scatter_single
    return dist.all_gather_into_tensor, dist.reduce_scatter_tensor


def prebuilt_ops() -> tuple[list[str], str | None]:
    """The ops compiled into the installed DeepSpeed (DS_BUILD_<OP>=1 at install time), and the
    accelerator they were built for (None where DeepSpeed does not record it: 0.13)."""
    from deepspeed import git_version_info as info

    built = sorted(name for name, on in info.installed_ops.items() if on)
    return built, getattr(info, "accelerator_name", None)


def optimizer_op(ds_config: dict) -> str | None:
    """The DeepSpeed op a config's optimizer needs, as DeepSpeed's engine picks it (0.13 and 0.19
    alike): none for torch's AdamW (torch_adam), cpu_adam with optimizer offload, else fused_adam."""
    if ds_config["optimizer"]["params"].get("torch_adam"):
        return None
    return "cpu_adam" if "offload_optimizer" in ds_config["zero_optimization"] else "fused_adam"


def _report_deepspeed_ops() -> None:
    from deepspeed.accelerator import get_accelerator

    from core.schemas.sft import SFTStage
    from stages import deepspeed_ops, engine

    built, built_for = prebuilt_ops()
    here = get_accelerator()._name  # what DeepSpeed's op loader compares with built_for
    usable = built if built_for in (None, here) else []
    where = f" for {built_for}" if built and built_for else ""
    unusable = (f"; not loaded here, where the accelerator is {here}: DeepSpeed JIT-builds them"
                if built and not usable else "")
    print(f"DeepSpeed ops prebuilt{where}: {', '.join(built) or 'none'}{unusable}")
    cached = deepspeed_ops.jit_built_ops()
    print(f"JIT-built extensions in {deepspeed_ops.extensions_dir()}: {', '.join(cached) or 'none'}")

    def status(op):
        if op in usable:
            return "prebuilt"
        return "JIT-built earlier, cached" if op in cached else "not built: compiled at the first step"

    choices = []
    for offload in (False, True):
        stage = SFTStage.model_validate({"name": "check", "kind": "sft", "model": "builtin:tiny-llama",
                                         "data": {"path": "builtin:digits"}, "optimizer_offload": offload})
        config = engine.deepspeed_config(stage, world_size=8, hidden_size=4096, on_gpu=True)
        op = optimizer_op(config)
        params = config["optimizer"]["params"]
        choice = (f"torch.optim.AdamW(fused={params.get('fused', False)}), no build" if op is None
                  else f"DeepSpeed {op} ({status(op)})")
        choices.append(f"{'with' if offload else 'without'} optimizer_offload: {choice}")
    print("optimizer of a GPU stage: " + "; ".join(choices))
    before = os.environ.get(ARCH_LIST)
    after = deepspeed_arch_list(before)
    change = "left as it is" if after == before else f"stage jobs use {after!r}" if after else "stage jobs unset it"
    print(f"{ARCH_LIST}: {'unset' if before is None else repr(before)}: {change}")


# --------------------------------------------------------------------------- self-check


@contextlib.contextmanager
def zero_init_style_constructors(dtype: torch.dtype):
    """What deepspeed.zero.Init does to tensor constructors (minus sharding), for a check
    on a machine where DeepSpeed's accelerator cannot start: floats come out in `dtype`."""
    originals = {name: getattr(torch, name) for name in _CONSTRUCTORS}

    def rounding(constructor):
        @functools.wraps(constructor)
        def construct(*args, **kwargs):
            tensor = constructor(*args, **kwargs)
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
            return tensor

        return construct

    default_dtype = torch.get_default_dtype()
    for name, constructor in originals.items():
        setattr(torch, name, rounding(constructor))
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(default_dtype)
        for name, constructor in originals.items():
            setattr(torch, name, constructor)


def rotary_error_under_zero3(positions: int = 4096) -> tuple[float | None, str]:
    """(max |cos/sin difference|, how it was built) between a tiny Llama loaded in fp32 and
    the same loaded in bf16 under ZeRO-3 and wrapped by DeepSpeed's engine; (None, why)
    when there is nothing faithful to compare.

    Uses the real zero.Init in a one-process group where DeepSpeed can start here; where
    it cannot (DeepSpeed 0.13 without a GPU), zero.Init-style constructors around the
    model's construction and the engine's cast, as the installed DeepSpeed does it."""
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=positions)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        reference = AutoModelForCausalLM.from_pretrained(folder, **from_pretrained_kwargs(torch.float32, "eager"))
        try:
            model, how = _load_under_real_zero3(AutoModelForCausalLM, folder, positions)
        except Exception as err:  # noqa: BLE001 - any failure to start DeepSpeed: emulate instead
            why = f"DeepSpeed could not start here: {type(err).__name__}: {str(err)[:160]}"
            if not rotary_patch_needed()[0]:
                # Here transformers' own ZeRO-3 loading re-initialises the frequencies, which
                # the emulation does not reproduce: it would report an error that does not exist.
                return None, why
            model = _load_under_zero_init_style(AutoModelForCausalLM, LlamaForCausalLM, folder)
            how = f"zero.Init-style constructors ({why})"
    worst = 0.0
    for ref_module, module in zip(_rotaries(reference), _rotaries(model)):
        for want, got in zip(rotary_cos_sin(ref_module, positions), rotary_cos_sin(module, positions)):
            worst = max(worst, (want - got.cpu()).abs().max().item())
    return worst, how


def _load_under_real_zero3(auto_class, folder: str, positions: int):
    import deepspeed

    started_here = not torch.distributed.is_initialized()
    if started_here:
        from stages.distributed import free_port

        for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = torch.distributed.get_world_size()
    ds_config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world,
                 "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    live = hf_deepspeed_config(ds_config)
    model, _ = from_pretrained(auto_class, folder, torch.bfloat16, "eager", positions)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    del live
    if started_here:
        remove_cpu_comm_buffer()  # a group of one: nobody else will open it
    return engine.module, f"deepspeed.zero.Init + deepspeed.initialize, DeepSpeed {versions()['deepspeed']}"


def _load_under_zero_init_style(auto_class, model_class, folder: str):
    init = model_class.__init__

    @functools.wraps(init)
    def init_under_zero_init(self, *args, **kwargs):
        with zero_init_style_constructors(torch.bfloat16):
            init(self, *args, **kwargs)

    model_class.__init__ = init_under_zero_init
    try:
        model = auto_class.from_pretrained(folder, **from_pretrained_kwargs(torch.bfloat16, "eager"))
    finally:
        model_class.__init__ = init
    if deepspeed_casts_buffers():
        return model.bfloat16()
    for param in model.parameters():
        param.data = param.data.bfloat16()
    return model


def _rotaries(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def self_check() -> int:
    """Print versions, patches and the rotary check; 0 when every check passes."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    prepare()
    print("versions:", "  ".join(f"{k} {v}" for k, v in versions().items()))
    off = disabled_patches()
    needed, reason = rotary_patch_needed()
    state = "off (switched off)" if "rotary_fp32" in off else ("applies" if needed else "not needed")
    print(f"rotary_fp32: {state}: {reason}")
    for cls in rotary_classes():
        print(f"  {cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}.forward{rotary_signature(cls)}")
    from transformers import LlamaConfig

    mask = registers_square_causal_mask(LlamaConfig())
    state = "off (switched off)" if "causal_mask_cap" in off else ("applies" if mask else "not needed")
    print(f"causal_mask_cap: {state}: LlamaModel {'registers' if mask else 'does not register'} a "
          "(max_position_embeddings^2) causal_mask buffer")
    print("from_pretrained dtype argument:", next(iter(from_pretrained_kwargs(torch.float32, "sdpa"))))
    _report_deepspeed_ops()

    error, how = rotary_error_under_zero3()
    if error is None:
        print(f"rotary cos/sin under ZeRO-3: not checked ({how}); rotary_fp32 does not apply here")
        return 0
    ok = error < 1e-5
    print(f"rotary cos/sin of a tiny Llama built in bf16 under ZeRO-3 vs fp32, positions 0-4095: "
          f"max |error| {error:.3g} ({'OK' if ok else 'FAILED: above 1e-5'}); built with {how}")
    return 0 if ok else 1


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m stages.compat", description=__doc__.split("\n")[0])
    parser.add_argument("--self-check", action="store_true", help="report versions and patches; run the CPU checks")
    args = parser.parse_args(argv)
    if not args.self_check:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return self_check()


if __name__ == "__main__":
    raise SystemExit(main())
