"""Ulysses sequence parallelism (DeepSpeed's ALST): `sequence_parallel` processes share each sequence.

Layout: consecutive ranks form a group (ranks 0..N-1, N..2N-1, ...), so with N up to the GPUs per
node the exchange stays inside a node. Every process of a group builds the same micro batch (the
rows are split over the groups: `Layout.data_rank` of `data_world`) and runs the model on its
1/N of every line's positions (`ShardedBatch`). Inside each attention layer DeepSpeed's
`UlyssesSPAttentionHF` exchanges heads for sequence (all-to-all): each process attends over the
whole sequence for 1/N of the heads, then the result goes back to sequence shards. Everything
outside attention is per position, so it needs nothing more.

Packed sequences stay apart as without sharing: the attention layers get the block-diagonal mask
of the whole line (stages/packed_attention.py's `sequences_apart`, given the line's full sequence map), which
is what each process's attention sees after the exchange; flash attention reads the boundaries from
the gathered position ids.

The loss: each process computes the next-token log-probs (or a reward head's scores) of its own
positions, and the group gathers them into whole lines (`ShardedBatch.gathered`), a few numbers per
position, never the logits. From there every stage's loss code runs unchanged, on every process of
the group alike. Gradients: each process sends back only its own positions' part, and DeepSpeed,
which sees every process as data-parallel, averages over all of them; the training loop already
scales each process's loss by the process count (stages/engine.py), so the step's gradient is the
one a single process would compute on the whole batch. Metrics are the same on the N processes of
a group: summed over processes they count once per group (stages/collectives.py sum_once_per_group).

Generation (RL) is not sharded: attention runs as usual outside `ShardedBatch.apart()`. Each
process of a group samples its share of the group's prompts whole and the group gathers the
completions (stages/rollout.py `RolloutMaker.sample`); the scoring and training passes then run
on shared batches like every other stage's.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core import sequence_parallel as rules
from core.errors import InvalidInput
from stages import data, packed_attention

log = logging.getLogger("stages")


@dataclass(frozen=True)
class Layout:
    """Who this process is among those that share sequences and those that split the rows."""

    size: int  # processes sharing each sequence (1: no sharing)
    rank: int  # this process's place in its group: which 1/size of each line it runs
    data_rank: int  # which share of the rows its group trains on
    data_world: int  # groups, i.e. shares of the rows
    group: object = None  # the torch process group of this process's sharing group


_layout = Layout(1, 0, 0, 1)
# The sharded batch whose forward (and backward) is running, if any: attention layers exchange
# only inside it. A plain module global for the reason packed_attention's packed batch is one (backward runs
# on autograd's device thread).
_active: ShardedBatch | None = None


def layout() -> Layout:
    return _layout


def setup(stage, rank: int, world_size: int) -> Layout:
    """Form the groups and make the attention registry's entries shard-aware (once per process,
    before any model is built; nothing to do for sequence_parallel 1). A stage that tiles its
    logits or MLPs is refused here where the stack cannot (a container's stack, which validate did not see)."""
    global _layout
    sequence_parallel = stage.sequence_parallel
    why = rules.tiles_problem(stage)
    if why:
        raise InvalidInput(why)
    if sequence_parallel == 1:
        _layout = Layout(1, 0, rank, world_size)
        return _layout
    why = rules.stack_problem()
    if why:
        raise InvalidInput(why)
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(sequence_parallel)
    group = parallel_state_sp.get_sequence_parallel_group()
    _layout = Layout(sequence_parallel, rank % sequence_parallel, rank // sequence_parallel,
                     world_size // sequence_parallel, group)
    _wrap_attention()
    first = rank - _layout.rank
    log.info("sequence_parallel %d: ranks %d-%d share each sequence (this one runs part %d of every line); the "
             "rows are split over %d data-parallel group%s", sequence_parallel, first, first + sequence_parallel - 1,
             _layout.rank + 1, _layout.data_world, "" if _layout.data_world == 1 else "s")
    return _layout


def _wrap_attention() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in ("sdpa", "flash_attention_2", "flash_attention_3"):
        if name in ALL_ATTENTION_FUNCTIONS and not getattr(ALL_ATTENTION_FUNCTIONS[name], "_ulysses", False):
            ALL_ATTENTION_FUNCTIONS[name] = _shard_aware(ALL_ATTENTION_FUNCTIONS[name])


def _shard_aware(core):
    """An attention function that, inside a sharded batch's pass, runs `core` through DeepSpeed's
    Ulysses exchange, and otherwise is `core`."""
    exchanges: dict = {}

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if _active is None:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        # DeepSpeed's exchange is built for one batch size and one model's heads.
        key_ = (query.shape[0], query.shape[1], key.shape[1], query.shape[-1])
        if key_ not in exchanges:
            exchanges[key_] = _exchange(core, module.config, query.shape[0])
        return exchanges[key_](module, query, key, value, attention_mask, *args, **kwargs)

    attention._ulysses = True  # type: ignore[attr-defined]  # marks the wrapped attention
    return attention


def _exchange(core, config, lines: int):
    """DeepSpeed's Ulysses attention around `core` for `lines` lines of this model. Where the
    processes outnumber the key-value heads, it copies them and sets the attention layer's
    num_key_value_groups to match, for good: the stages that share run every pass shared."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return UlyssesSPAttentionHF(
        attn=core, batch_size=lines, attn_head_count=heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
        kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
        num_hidden_layers=text.num_hidden_layers, process_group=_layout.group, seq_length_is_variable=True)


# --------------------------------------------------------------------------- batches


class _Gather(torch.autograd.Function):
    """The group's (lines, width/N, ...) pieces side by side on dim 1. Every process of the group
    computes the same loss from the gathered tensor, so each sends back only the gradient of
    its own piece."""

    @staticmethod
    def forward(ctx, piece, start: int, stop: int):
        parts = [torch.empty_like(piece) for _ in range(_layout.size)]
        dist.all_gather(parts, piece.contiguous(), group=_layout.group)
        ctx.start, ctx.stop = start, stop
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.start:ctx.stop], None, None


@dataclass
class ShardedBatch(data.Batch):
    """A micro batch whose lines this process runs 1/N of (positions start:stop of each line,
    the width padded to a multiple of N). Its tensors are the whole lines, so what is counted or
    read per sequence (lengths, loss mask, per_sequence, last_tokens) is as without sharing; the
    model sees only this process's positions, and `logprobs` gathers what they give."""

    start: int = 0
    stop: int = 0

    @classmethod
    def of(cls, batch: data.Batch, layout_: Layout) -> ShardedBatch:
        whole = _padded_to(batch, layout_.size)
        width = whole.input_ids.shape[1] // layout_.size
        return cls(**vars(whole), start=layout_.rank * width, stop=(layout_.rank + 1) * width)

    @contextlib.contextmanager
    def apart(self):
        """The whole lines' sequences kept apart (packed_attention), and attention exchanging over the group."""
        global _active
        outer, _active = _active, self
        try:
            # Padded lines too: after the exchange attention sees whole lines, which only the
            # whole lines' sequence map describes.
            with packed_attention.sequences_apart(self.sequence):
                yield
        finally:
            _active = outer

    def forward(self, model, **extra):
        part = slice(self.start, self.stop)
        inputs = {"input_ids": self.input_ids[:, part], "position_ids": self.position_ids[:, part],
                  "use_cache": False, **extra}
        with self.apart():
            return model(**inputs)

    def gathered(self, per_position):
        """(lines, width, ...) from this process's (lines, width/N, ...) piece."""
        return _Gather.apply(per_position, self.start, self.stop)

    def next_targets(self):
        """As Batch.next_targets, for this process's positions."""
        return tuple(entries[:, self.start:self.stop] for entries in super().next_targets())


def _padded_to(batch, size: int):
    """The batch with its lines widened to a multiple of `size`: padding (sequence -1, no loss),
    with positions of a padding sequence of its own."""
    width = batch.input_ids.shape[1]
    extra = -width % size
    if not extra:
        return batch
    lines = batch.input_ids.shape[0]

    def widen(tensor, fill):
        return torch.cat([tensor, torch.full((lines, extra), fill, dtype=tensor.dtype, device=tensor.device)], 1)

    positions = torch.arange(extra, device=batch.position_ids.device).expand(lines, extra)
    return type(batch)(widen(batch.input_ids, 0), torch.cat([batch.position_ids, positions], 1),
                       widen(batch.loss_mask, 0), widen(batch.sequence, -1), batch.packed, batch.lengths)


def shard(batch: data.Batch) -> data.Batch:
    """This process's part of a micro batch (the batch itself without sharing)."""
    return ShardedBatch.of(batch, _layout) if _layout.size > 1 else batch
