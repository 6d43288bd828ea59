"""What the rows of an optimizer step become on each process: micro batches, and the
lines of each micro batch's (lines x width) tensor, simulated with core/batching.py
— the code the stages batch with — over the token lengths of sampled rows
(pipeline/lengths.py), or every row max_len long where the data could not be read.

Packed (sft, rm, dpo by default): pack_rows gives each process about the same
tokens in micro batches of at most the token budget; pack_lines lays each micro
batch's sequences on lines about as long as its longest sequence for sdpa and eager
(their mask then covers whole lines), on one flat line for flash attention. Padded: each process
takes micro_batch_size rows in turn, every sequence padded to the micro batch's
longest. Real tokens are the sequences' own; processed tokens are lines x width.

Sequence parallel (sequence_parallel N > 1): the rows are split over processes / N groups,
whose N processes share each micro batch (stages/sequence_parallel.py): its lines are widened
to a multiple of N and each process runs 1/N of every line's positions, and 1/N of the heads
of attention over the whole lines. `steps[s][g]` is then group g's micro batches.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from core.batching import line_tokens, pack_lines, pack_rows, round_robin, rows_per_step, token_budget
from pipeline.lengths import RowLengths
from pipeline.plan.inputs import Knobs

SIMULATED_STEPS = 8  # global batches drawn from the sample


@dataclass(frozen=True)
class Line:
    """One line of a micro batch tensor: `width` positions holding these sequences."""

    width: int
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class MicroBatchLayout:
    lines: tuple[Line, ...]
    counts: bool = True  # False: a filler pass that keeps processes in lockstep and learns nothing

    @property
    def real_tokens(self) -> int:
        return sum(sum(line.lengths) for line in self.lines) if self.counts else 0

    @property
    def processed_tokens(self) -> int:
        return sum(line.width for line in self.lines)

    def attended(self, masked: bool) -> int:
        """Query-key pairs its attention scores: whole lines under a mask, else each sequence's own."""
        if masked:
            return sum(line.width * line.width for line in self.lines)
        return sum(n * n for line in self.lines for n in line.lengths)

    @property
    def sequences(self) -> tuple[int, ...]:
        return tuple(n for line in self.lines for n in line.lengths)

    def per_process(self, masked: bool, share: int) -> tuple[float, float]:
        """(positions, query-key pairs) one of the `share` processes that share this micro batch
        computes: 1/share of every line's positions, attention over whole lines for 1/share of the heads."""
        return self.processed_tokens / share, self.attended(masked) / share


@dataclass(frozen=True)
class Batches:
    """Simulated optimizer steps: steps[s][p] is process p's micro batches in step s."""

    steps: tuple[tuple[tuple[MicroBatchLayout, ...], ...], ...]  # [step][data-parallel group][micro batch]
    rows_per_step: int
    packed: bool
    masked: bool  # sdpa, eager: attention over whole lines (a mask keeps sequences apart); flash: each sequence's own
    token_budget: int | None
    lengths: RowLengths | None  # None or empty: every row assumed max_len long
    row_tokens: tuple[int, ...]  # each sampled row's tokens after truncation to max_len
    sequence_parallel: int = 1  # processes sharing each micro batch

    def _per_step(self, value) -> float:
        return sum(value(step) for step in self.steps) / len(self.steps)

    @property
    def micro_batches_per_step(self) -> float:
        """Forward passes per step on each process (the same on every process)."""
        return self._per_step(lambda step: max(len(mine) for mine in step))

    @property
    def real_tokens_per_step(self) -> float:
        return self._per_step(lambda step: sum(m.real_tokens for mine in step for m in mine))

    @property
    def processed_tokens_per_step(self) -> float:
        return self._per_step(lambda step: sum(m.processed_tokens for mine in step for m in mine))

    @property
    def padding_share(self) -> float:
        return 1 - self.real_tokens_per_step / max(self.processed_tokens_per_step, 1)

    @property
    def mean_row_tokens(self) -> float:
        return sum(self.row_tokens) / len(self.row_tokens)

    @property
    def p95_row_tokens(self) -> int:
        ordered = sorted(self.row_tokens)
        return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def simulate(knobs: Knobs, world: int, sequences_per_row: int, flat: bool, lengths: RowLengths | None) -> Batches:
    """Optimizer steps of a sft/rm/dpo stage as its `world` processes will run them. `flat`: the
    attention kernel takes packed sequences on one line (flash attention). ValueError when
    sequence_parallel does not divide the processes."""
    sampled = lengths.rows if lengths is not None and lengths.sampled else ()
    budget = token_budget(knobs, sequences_per_row) if knobs.packs else None
    groups = knobs.data_parallel(world)
    rows = rows_per_step(knobs.global_batch_size, knobs.micro_batch_size, groups)
    return _simulate(sampled, knobs.max_len, sequences_per_row, rows, knobs.micro_batch_size, groups, budget, flat,
                     lengths, knobs.sequence_parallel)


@functools.lru_cache(maxsize=256)
def _simulate(sampled: tuple, max_len: int, sequences_per_row: int, rows_per_step: int, micro_batch_size: int,
              world: int, budget: int | None, flat: bool, lengths: RowLengths | None, share: int = 1) -> Batches:
    """`world`: the data-parallel groups; `share`: the processes of each."""
    rows = [tuple(min(n, max_len) for n in row) for row in sampled] or [(max_len,) * sequences_per_row]
    rng = random.Random(0)
    if not sampled:
        draws = [[0] * rows_per_step]  # every row alike: one step says it all
    elif len(rows) >= rows_per_step:
        draws = [list(range(s * rows_per_step, (s + 1) * rows_per_step))
                 for s in range(min(SIMULATED_STEPS, len(rows) // rows_per_step))]
    else:  # fewer sampled rows than a step takes: draw steps from them with replacement
        draws = [rng.choices(range(len(rows)), k=rows_per_step) for _ in range(SIMULATED_STEPS)]
    steps = []
    for drawn in draws:
        step_rows = [rows[i] for i in drawn]
        totals = [sum(r) for r in step_rows]
        if budget is not None:
            per_process = pack_rows(list(range(len(step_rows))), totals, world, budget)
            step = tuple(tuple(_packed(step_rows, m.rows, m.weight > 0, flat, share) for m in mine)
                         for mine in per_process)
        else:
            step = tuple(tuple(_padded(step_rows, m.rows, share) for m in round_robin(list(range(len(step_rows))),
                                                                                    micro_batch_size, rank, world))
                         for rank in range(world))
        steps.append(step)
    return Batches(tuple(steps), rows_per_step, budget is not None, not flat, budget, lengths,
                   tuple(sum(r) for r in rows), share)


def _widened(width: int, share: int) -> int:
    """A line's width once widened to a multiple of the processes that share it."""
    return -(-width // share) * share


def _packed(rows: list[tuple[int, ...]], picked: tuple[int, ...], counts: bool, flat: bool,
            share: int = 1) -> MicroBatchLayout:
    sequences = [n for i in picked for n in rows[i]]
    lines = pack_lines(sequences, line_tokens(sequences, flat))
    width = _widened(max(sum(sequences[k] for k in line) for line in lines), share)
    return MicroBatchLayout(tuple(Line(width, tuple(sequences[k] for k in line)) for line in lines), counts)


def _padded(rows: list[tuple[int, ...]], picked: tuple[int, ...], share: int = 1) -> MicroBatchLayout:
    sequences = [n for i in picked for n in rows[i]]
    width = _widened(max(sequences), share)
    return MicroBatchLayout(tuple(Line(width, (n,)) for n in sequences))
