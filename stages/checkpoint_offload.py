"""checkpoint_offload: gradient checkpointing whose checkpointed layer inputs wait in host memory.

With gradient checkpointing every decoder layer keeps its input (positions x hidden) on the GPU
until the backward recomputes the layer: layers x positions x hidden x bytes, the largest thing a
long sequence leaves on the GPU once the logits and MLPs are tiled (Llama-3.1-8B at 3.7M tokens
shared by 8: 118 GB a GPU). Here each layer's input is copied to pinned host memory as the
forward leaves the layer and brought back when the backward reaches it, which recomputes the
layer from it and backpropagates through it, as ALST does (arXiv 2506.13996: DeepSpeed's
checkpointing with CPU offload). The copies run on the compute stream, so they are ordered with
the layers' kernels and the plan counts them as exposed (pipeline/plan/timing.py).

It replaces the checkpoint function transformers calls for each decoder layer
(`_gradient_checkpointing_func(layer_call, hidden_states, *args)` on 4.38 and 5.x alike) with a
recompute-in-backward function of its own: the same forward and the same gradients as the plain
path, the layer's parameters' gradients accumulated by the inner backward (as torch's reentrant
checkpoint does; DeepSpeed's ZeRO hooks see them the same way).
"""

from __future__ import annotations

import torch

HOOK = "_gradient_checkpointing_func"


def enable(model) -> int:
    """Route every checkpointed layer of `model` (checkpointing enabled first) through the offloading
    checkpoint; returns how many modules call it. ValueError when none does (an architecture
    transformers does not checkpoint through that hook)."""
    modules = [m for m in model.modules() if hasattr(m, HOOK)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no checkpointed layers to offload "
                         "(transformers' gradient checkpointing hook is missing)")
    for module in modules:
        setattr(module, HOOK, offloaded_checkpoint)
    return len(modules)


def offloaded_checkpoint(function, hidden_states, *args, **kwargs):
    """function(hidden_states, *args, **kwargs) run without keeping what the backward needs; its
    input copied to host memory and brought back to recompute it in the backward."""
    if kwargs:
        def function(*inner, _call=function, _kwargs=kwargs):
            return _call(*inner, **_kwargs)
    return _OffloadedLayer.apply(function, hidden_states, *args)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor.detach(), non_blocking=True)


def _devices(tensor: torch.Tensor) -> list:
    return [tensor.device] if tensor.device.type == "cuda" else []


class _OffloadedLayer(torch.autograd.Function):
    """A checkpointed layer whose input waits on the host (see the module doc). Tensor arguments
    other than the layer input (masks, positions) stay where they are: small beside it."""

    @staticmethod
    def forward(ctx, function, hidden_states, *args):
        ctx.function = function
        ctx.device = hidden_states.device
        ctx.input_requires_grad = hidden_states.requires_grad
        ctx.host = _to_host(hidden_states)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in _devices(hidden_states)]
        ctx.save_for_backward(*(a for a in args if torch.is_tensor(a)))
        ctx.tensor_slots = [torch.is_tensor(a) for a in args]
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        with torch.no_grad():
            return function(hidden_states, *args)

    @staticmethod
    def backward(ctx, *grads):
        hidden_states = ctx.host.to(ctx.device, non_blocking=True).requires_grad_(ctx.input_requires_grad)
        ctx.host = None
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if slot else a for slot, a in zip(ctx.tensor_slots, ctx.args)]
        inputs = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args]
        devices = [ctx.device] if ctx.cuda_rng else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                outputs = ctx.function(hidden_states, *inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grads)
                 if torch.is_tensor(out) and out.requires_grad and grad is not None]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        input_grads = [a.grad if torch.is_tensor(a) and a.requires_grad else None for a in inputs]
        return (None, hidden_states.grad if ctx.input_requires_grad else None, *input_grads)
