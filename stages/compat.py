"""Every difference between the supported transformers / DeepSpeed versions, in one place.

Supported stacks: the pinned one (transformers 4.38.2, DeepSpeed 0.13.2, peft 0.10), the
current one (transformers 5.x, DeepSpeed 0.19), and transformers 4.37.2 for loading.
Nothing else in the project asks which version is installed: it calls this module, or one of
the modules beside it that do one of its jobs: stages/pretrained.py (loading a folder and what
loading found), stages/rotary_fp32.py (the rotary patch's mechanics), stages/packed_attention.py
(packed sequences kept apart in attention) and stages/self_check.py (`python -m stages.self_check`).

Load-time patches. `prepare()` applies them (stages/pretrained.py calls it before it builds a
model); each one applies only where the installed versions need it and logs once what it did.

- rotary_fp32: rotary embeddings keep their frequencies and cos/sin in fp32.
  `deepspeed.zero.Init` replaces torch's tensor constructors with ones that round every
  floating result to the training dtype, so on transformers 4.37 the cos/sin caches are
  built from bf16 positions (cos off by up to 2 at position 4096); and DeepSpeed 0.13's
  engine casts every buffer to bf16 with the parameters, so on 4.38 `inv_freq` loses
  precision (cos off by up to 0.71 at position 4096). stages/rotary_fp32.py builds rotary
  modules with the real constructors in fp32 and keeps their fp32 buffers through later dtype
  casts; the forward pass is left alone, whatever its signature: 4.37 `(x, seq_len)`, 4.38
  `(x, position_ids, seq_len=None)`, 5.x `(x, position_ids)`.
  Not applied where transformers re-initialises the frequencies after construction and
  DeepSpeed casts only parameters (transformers 5.x with DeepSpeed 0.19).
- causal_mask_cap: transformers 4.38.0-4.38.2 registers a max_position_embeddings^2 bool
  `causal_mask` buffer; stages/pretrained.py caps the positions at load and puts them back
  for export.
- logits_native_dtype: causal LMs of transformers before 4.45 (4.38: Llama, Mistral, Mixtral,
  Qwen2) upcast all logits to fp32 in their forward, a (tokens x vocab) fp32 copy per micro
  batch; the stages' passes (no cache, no labels) get logits in the model's dtype instead,
  and stages/losses.py reads log-probs from them in fp32 chunk by chunk.
- flash_varlen: flash attention in transformers before 4.44 reads no packed sequences from
  position ids; `_flash_attention_forward` is patched to call flash_attn_varlen_func with
  the boundaries of the packed batch that stages/packed_attention.py's `sequences_apart` names.

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
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import re

import torch

from core.shapes import PATCHED_FAMILIES
from stages.packed_attention import varlen_when_packed
from stages.rotary_fp32 import built_in_fp32, fp32_buffers_follow_devices_only, rotary_signature

log = logging.getLogger("stages")

OFF_SWITCH = "POST_TRAIN_COMPAT_OFF"
PATCHES = ("rotary_fp32", "causal_mask_cap", "flash_varlen", "logits_native_dtype")

# The modelling modules of the families the load-time patches cover (core/shapes.py's list).
_MODEL_MODULES = tuple(f"transformers.models.{t}.modeling_{t}" for t in PATCHED_FAMILIES)

_logged: set[str] = set()
_applied: dict[str, list] = {}  # patch name -> [(owner, attribute, previous value or _ABSENT)]
_ABSENT = object()


def log_once(key: str, message: str, *args) -> None:
    """Log `message` at INFO, prefixed 'compat: ', the first time `key` is seen in this process."""
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


def transformers_version():
    """The installed transformers' version, as a comparable packaging Version."""
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
    dtype_key = "dtype" if transformers_version() >= Version("4.56") else "torch_dtype"
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


def static_decoding_unavailable() -> str | None:
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


# --------------------------------------------------------------------------- load-time patches


def prepare() -> None:
    """Apply the load-time patches the installed versions need (once; later calls are free)."""
    off = disabled_patches()
    for name in PATCHES:
        if name in off:
            log_once(f"off:{name}", "%s switched off (%s)", name, OFF_SWITCH)
            _revert(name)
    if "rotary_fp32" not in off and "rotary_fp32" not in _applied:
        needed, reason = rotary_patch_needed()
        if needed:
            classes = _apply_rotary_fp32()
            log_once("rotary_fp32", "rotary_fp32 applied (%s): %s", reason,
                     ", ".join(f"{c.__name__}{rotary_signature(c)}" for c in classes))
        else:
            _applied["rotary_fp32"] = []  # decided: nothing to change
            log_once("rotary_fp32", "rotary_fp32 not needed: %s", reason)
    if "logits_native_dtype" not in off and "logits_native_dtype" not in _applied:
        classes = _apply_native_logits()
        if classes:
            log_once("logits_native_dtype", "logits_native_dtype applied (transformers %s returns fp32 logits): %s",
                     versions()["transformers"], ", ".join(c.__name__ for c in classes))
    if "flash_varlen" not in off and "flash_varlen" not in _applied:
        if _flash_varlen_patch_needed():
            classes = _apply_flash_varlen()
            log_once("flash_varlen", "flash_varlen applied (transformers %s reads no packed sequences from "
                     "positions): %s", versions()["transformers"], ", ".join(c.__name__ for c in classes))
        else:
            _applied["flash_varlen"] = []


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


def rotary_classes() -> list[type[torch.nn.Module]]:
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


def _apply_rotary_fp32() -> list[type[torch.nn.Module]]:
    classes = rotary_classes()
    changes = []
    for cls in classes:
        if "__init__" in vars(cls):
            changes.append((cls, "__init__", vars(cls)["__init__"]))
            cls.__init__ = built_in_fp32(vars(cls)["__init__"])
        if not any(issubclass(cls, other) and cls is not other for other in classes):
            changes.append((cls, "_apply", vars(cls).get("_apply", _ABSENT)))
            cls._apply = fp32_buffers_follow_devices_only
    _applied["rotary_fp32"] = changes
    return classes


def _revert(name: str) -> None:
    for owner, attribute, previous in reversed(_applied.pop(name, [])):
        if previous is _ABSENT:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, previous)


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
            cls._flash_attention_forward = varlen_when_packed(original, module)
    _applied["flash_varlen"] = changes
    return [c[0] for c in changes]


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
    log_once("arch_list", "%s=%r rewritten to %s: DeepSpeed's op builder reads only MAJOR.MINOR[+PTX] entries",
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
