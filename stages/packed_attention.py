"""Packed batches keep their sequences apart in every attention layer (stages/data.py packs them).

`install_packing_hooks`, called for every model stages/pretrained.py `from_pretrained` loads, lets
each attention layer keep packed sequences apart inside `sequences_apart`: eager and sdpa layers
get a block-diagonal causal mask (an additive 4D mask is what attention layers take on every
supported version, below each model's own mask preparation, which differs between versions and
model families), flash attention the sequence boundaries: transformers 5 reads them from the
position ids of a single flat line; before 4.44 stages/compat.py's flash_varlen patch wraps
`_flash_attention_forward` in `varlen_when_packed`, which calls flash_attn_varlen_func.
"""

from __future__ import annotations

import contextlib
import functools

import torch


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
_packed: PackedSequences | None = None


@contextlib.contextmanager
def sequences_apart(sequence: torch.Tensor | None):
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


def varlen_when_packed(original, module):
    """`original` (a model class's `_flash_attention_forward`, transformers before 4.44) calling
    `module`'s flash_attn_varlen_func with the packed sequences' boundaries inside `sequences_apart`."""
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
