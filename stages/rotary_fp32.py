"""fp32 rotary embeddings under DeepSpeed's zero.Init: the mechanics of stages/compat.py's rotary_fp32 patch.

`deepspeed.zero.Init` replaces torch's tensor constructors with ones that round every floating
result to the training dtype, and DeepSpeed 0.13's engine casts every buffer with the parameters.
`built_in_fp32` wraps a rotary class's __init__ so that it builds with the real constructors and
fp32 as the default dtype (`exact_tensor_constructors`); `fp32_buffers_follow_devices_only` is a
Module._apply that lets later dtype casts move fp32 buffers between devices without converting
them. The forward pass is left alone, whatever its signature; `rotary_cos_sin` reads the signature
to call it. `zero_init_style_constructors` does what zero.Init does to the constructors (minus
sharding), for stages/self_check.py on a machine where DeepSpeed cannot start.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

# The constructors zero.Init intercepts (DeepSpeed 0.13 to 0.19).
CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


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
                        "nor seq_len; stages/rotary_fp32.py does not know how to call it")
    return cos.reshape(positions, -1).float(), sin.reshape(positions, -1).float()


def _rotary_dim(module) -> int:
    inv_freq = getattr(module, "inv_freq", None)
    if inv_freq is not None:
        return 2 * inv_freq.shape[-1]
    return int(module.dim)


def built_in_fp32(init):
    """A rotary class's `__init__` that builds with the real tensor constructors, in fp32."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        with exact_tensor_constructors():
            init(self, *args, **kwargs)

    return __init__


@contextlib.contextmanager
def _constructors_replaced(replacements: dict, default_dtype: torch.dtype):
    """torch's constructors named in `replacements` replaced by their values, and `default_dtype`
    torch's default dtype, until exit; then both are put back."""
    originals = {name: getattr(torch, name) for name in replacements}
    previous_dtype = torch.get_default_dtype()
    for name, constructor in replacements.items():
        setattr(torch, name, constructor)
    torch.set_default_dtype(default_dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous_dtype)
        for name, constructor in originals.items():
            setattr(torch, name, constructor)


@contextlib.contextmanager
def exact_tensor_constructors():
    """Inside zero.Init, torch's tensor constructors round every floating result to the
    training dtype. In here the real constructors are back, still putting new tensors on
    the device the intercepting ones would have used, with fp32 as the default dtype."""
    device = torch.empty(0).device
    replacements = {}
    for name in CONSTRUCTORS:
        current, real = getattr(torch, name), getattr(torch._C._VariableFunctions, name, None)
        if real is not None and current is not real:
            replacements[name] = _on_device(real, device)
    with _constructors_replaced(replacements, torch.float32):
        yield


def _on_device(constructor, device):
    @functools.wraps(constructor)
    def construct(*args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = device
        return constructor(*args, **kwargs)

    return construct


def fp32_buffers_follow_devices_only(self, fn, *args, **kwargs):
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


@contextlib.contextmanager
def zero_init_style_constructors(dtype: torch.dtype):
    """What deepspeed.zero.Init does to tensor constructors (minus sharding), for a check
    on a machine where DeepSpeed's accelerator cannot start: floats come out in `dtype`."""
    with _constructors_replaced({name: _rounding(getattr(torch, name), dtype) for name in CONSTRUCTORS}, dtype):
        yield


def _rounding(constructor, dtype: torch.dtype):
    @functools.wraps(constructor)
    def construct(*args, **kwargs):
        tensor = constructor(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype)
        return tensor

    return construct
