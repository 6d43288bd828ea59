"""Which rows each process trains on, in which micro batch, at each optimizer step.

Torch-free: the planner (pipeline/plan) simulates packing with the same code.

An optimizer step takes the next `rows_per_step` rows of the epoch's shuffled
order (the global batch); the order depends only on (seed, epoch), so a resumed
run sees exactly the rows an uninterrupted one would. How those rows are split
into micro batches does not change what is learned, because every stage
normalises its loss by the whole step (per-token or per-row means over the
global batch, over all processes):

- padded (packing off): each process takes `micro_batch_size` rows per micro
  batch, round-robin, and each micro batch is padded to its longest row;
- packed (packing on): rows go to processes so that each gets about the same
  number of tokens, and each process fills micro batches up to a token budget
  (first-fit decreasing). The sequences of a micro batch are laid out without
  padding and kept apart by their own positions (see `pack_lines`).

ZeRO needs every process to run the same number of forward passes per step:
processes with fewer packed micro batches split their fullest ones, and where
that cannot help, run a filler pass whose loss counts zero (`weight` 0).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatch:
    """Row indices for one forward/backward pass of one process."""

    rows: tuple[int, ...]
    weight: float = 1.0  # 0: a filler pass that keeps processes in lockstep and counts nothing


@dataclass(frozen=True)
class Step:
    """One optimizer step as one process sees it."""

    micro_batches: tuple[MicroBatch, ...]  # this process's
    rows: tuple[int, ...]  # every row of the step, over all processes


def shuffled(n_rows: int, seed: int, epoch: int) -> list[int]:
    """The epoch's row order: depends only on (seed, epoch)."""
    order = list(range(n_rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def steps_per_epoch(n_rows: int, rows_per_step: int) -> int:
    """Optimizer steps in an epoch; the ragged tail of the shuffled order is left out."""
    return n_rows // rows_per_step


def epoch_steps(n_rows: int, *, rows_per_step: int, micro_batch_size: int, rank: int, world_size: int,
                seed: int, epoch: int, lengths: Sequence[int] | None = None,
                token_budget: int | None = None) -> list[Step]:
    """This process's steps of one epoch. Packed when a token budget (and each row's
    token length) is given, padded micro batches of micro_batch_size rows otherwise."""
    order = shuffled(n_rows, seed, epoch)
    steps = []
    for k in range(steps_per_epoch(n_rows, rows_per_step)):
        rows = order[k * rows_per_step : (k + 1) * rows_per_step]
        if token_budget is None:
            mine = round_robin(rows, micro_batch_size, rank, world_size)
        else:
            assert lengths is not None, "packing needs each row's token length"
            mine = pack_rows(rows, lengths, world_size, token_budget)[rank]
        steps.append(Step(tuple(mine), tuple(rows)))
    return steps


def eval_micro_batches(n_rows: int, *, micro_batch_size: int, rank: int, world_size: int,
                       lengths: Sequence[int] | None = None,
                       token_budget: int | None = None) -> list[MicroBatch]:
    """This process's share of the evaluation rows: every row once over all processes,
    the same number of passes on every process (fillers have weight 0)."""
    rows = list(range(n_rows))
    if token_budget is not None:
        assert lengths is not None, "packing needs each row's token length"
        return list(pack_rows(rows, lengths, world_size, token_budget)[rank])
    per_round = micro_batch_size * world_size
    total = -(-n_rows // per_round) * per_round
    padded = rows + [None] * (total - n_rows)
    out = []
    for start in range(0, total, per_round):
        mine = padded[start + rank * micro_batch_size : start + (rank + 1) * micro_batch_size]
        real = tuple(i for i in mine if i is not None)
        out.append(MicroBatch(real, 1.0) if real else MicroBatch((0,), 0.0))
    return out


def round_robin(rows: list[int], micro_batch_size: int, rank: int, world_size: int) -> list[MicroBatch]:
    """This process's padded micro batches of a step's rows: micro_batch_size rows each, in turn."""
    per_round = micro_batch_size * world_size
    return [MicroBatch(tuple(rows[start + rank * micro_batch_size : start + (rank + 1) * micro_batch_size]))
            for start in range(0, len(rows), per_round)]


def by_length(rows: Sequence[int], lengths: Sequence[int], size: int) -> list[list[int]]:
    """`rows` in chunks of `size`, shortest first (lengths[row]; equal lengths keep their order), so
    a padded chunk pads only to its own longest row. RL's scoring passes and training micro batches
    use it: each row's numbers are computed on their own, and each micro batch's loss is its share
    of the whole step's, so how rows are grouped changes no result beyond float rounding."""
    order = sorted(rows, key=lambda row: lengths[row])
    return [order[start : start + size] for start in range(0, len(order), size)]


# --------------------------------------------------------------------------- packing


def pack_rows(rows: Sequence[int], lengths: Sequence[int], world_size: int,
              token_budget: int) -> list[list[MicroBatch]]:
    """Every process's micro batches for these rows: about equal tokens per process,
    micro batches of at most token_budget tokens, the same count on every process."""
    if not rows:
        raise ValueError("no rows to pack")
    # Longest first, each to the process with the fewest tokens so far (ties: lowest rank).
    by_length = sorted(rows, key=lambda i: -lengths[i])
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in by_length:
        p = min(range(world_size), key=lambda r: (load[r], r))
        shares[p].append(i)
        load[p] += lengths[i]
    bins = [_first_fit_decreasing(share, lengths, token_budget) for share in shares]
    count = max(len(b) for b in bins)
    out = []
    for share, mine in zip(shares, bins):
        while len(mine) < count and any(len(b) > 1 for b in mine):
            fullest = max(range(len(mine)), key=lambda j: (len(mine[j]), -j))
            half = len(mine[fullest]) // 2
            mine[fullest:fullest + 1] = [mine[fullest][:half], mine[fullest][half:]]
        batches = [MicroBatch(tuple(b)) for b in mine]
        filler = min(share or rows, key=lambda i: lengths[i])
        batches += [MicroBatch((filler,), 0.0)] * (count - len(batches))
        out.append(batches)
    return out


def _first_fit_decreasing(rows: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(rows, key=lambda r: -lengths[r]):
        size = lengths[i]
        j = next((j for j, free in enumerate(room) if free >= size), None)
        if j is None:  # a row longer than the budget still gets a micro batch of its own
            bins.append([i])
            room.append(budget - size)
        else:
            bins[j].append(i)
            room[j] -= size
    return bins


def line_tokens(lengths: Sequence[int], flat: bool) -> int:
    """How long pack_lines makes the lines of a micro batch of sequences of these lengths.
    Varlen kernels (flash attention) take every sequence on one line (0). Masked attention
    (sdpa, eager) attends over whole lines, at a cost that grows with each line's width
    squared: lines as short as the longest sequence allows. (Lines of max_len, as before,
    did ~100x the attention work for 20-token rows at max_len 2048: a 48-layer DPO
    reference pass of 674 such pairs took minutes on 8 CPU processes, not seconds.)"""
    return 0 if flat else max(lengths)


def pack_lines(lengths: Sequence[int], line_tokens: int, max_padding: float = 0.03) -> list[list[int]]:
    """Sequences (by index) laid out on lines of one packed (lines x width) tensor.

    Every line is as wide as the longest, so a line that lacks tokens is padding;
    attention (with a block-diagonal mask) costs about lines x width^2. So: the
    most lines, each about line_tokens long (see `line_tokens`) or longer, that
    keep padding within max_padding; sequences go longest first onto the shortest
    line. One line (no padding at all) is the limit; line_tokens=0 asks for it."""
    total = sum(lengths)
    most = max(1, min(len(lengths), total // line_tokens if line_tokens else 1))
    for count in range(most, 0, -1):
        lines: list[list[int]] = [[] for _ in range(count)]
        load = [0] * count
        for i in sorted(range(len(lengths)), key=lambda s: -lengths[s]):
            j = min(range(count), key=lambda k: (load[k], k))
            lines[j].append(i)
            load[j] += lengths[i]
        if total >= (1 - max_padding) * count * max(load):
            break
    return [sorted(line) for line in lines]


def token_budget(stage, sequences_per_row: int) -> int:
    """Tokens per process per packed micro batch: micro_batch_tokens, else what a padded
    micro batch of micro_batch_size rows of max_len tokens would hold."""
    return stage.micro_batch_tokens or stage.micro_batch_size * stage.max_len * sequences_per_row


def data_parallel(processes: int, sequence_parallel: int = 1) -> int:
    """Processes that train on different rows: `sequence_parallel` consecutive processes share
    each sequence (stages/sequence_parallel.py), so the rows are split over processes / that.
    ValueError when it does not divide the processes."""
    if processes % sequence_parallel:
        raise ValueError(f"{sequence_parallel} does not divide the stage's {processes} processes: each sequence "
                         f"is shared by sequence_parallel processes, so it must divide them")
    return processes // sequence_parallel


def rows_per_step(global_batch_size: int | None, micro_batch_size: int, processes: int) -> int:
    """Rows (a rollout kind: sequences) in one optimizer step over all processes: global_batch_size,
    else one micro batch per process."""
    return global_batch_size or micro_batch_size * processes


def accumulation_steps(global_batch_size: int | None, micro_batch_size: int, processes: int) -> int:
    """Micro batches each process adds up per optimizer step; ValueError when global_batch_size
    does not split into whole micro batches over the processes (the data-parallel ones:
    `data_parallel`)."""
    per_pass = micro_batch_size * processes
    rows = rows_per_step(global_batch_size, micro_batch_size, processes)
    if rows % per_pass:
        raise ValueError(f"global_batch_size {rows} is not a multiple of micro_batch_size x processes = "
                         f"{micro_batch_size} x {processes}")
    return rows // per_pass


# --------------------------------------------------------------------------- rollouts (RL)
# A rollout samples samples_per_prompt completions of each of its prompts. The prompts are split
# over the data-parallel groups (`data_parallel`): every process of a group holds all of the group's
# sequences, and samples its 1/sequence_parallel of the group's prompts. The rollout's update makes
# `passes` passes over its sequences in optimizer steps.


def rollout_sequences(prompts: int, samples_per_prompt: int) -> int:
    """Sequences sampled from `prompts` prompts (a rollout's, over all processes, or a share of it)."""
    return prompts * samples_per_prompt


def sampled_per_process(prompts: int, samples_per_prompt: int, processes: int) -> int:
    """Sequences each process samples of a rollout: its 1/processes of the prompts, whole."""
    return rollout_sequences(prompts // processes, samples_per_prompt)


@dataclass(frozen=True)
class RolloutSchedule:
    """How prompts become rollouts, and rollouts optimizer steps."""

    prompts_per_group: int  # a data-parallel group's prompts per rollout (a process's, without shared sequences)
    groups: int  # data-parallel groups: the processes, or processes / sequence_parallel
    steps_per_rollout: int  # optimizer steps of one rollout's update (all its passes)
    rollouts_per_epoch: int
    total_steps: int
    total_rollouts: int
    n_prompts: int
    prompts: int  # per rollout, over all processes
    seed: int

    @classmethod
    def of(cls, n_prompts: int, *, prompts: int, samples_per_prompt: int, passes: int, groups: int,
           sequences_per_step: int, epochs: int, max_steps: int | None, seed: int) -> RolloutSchedule:
        """`sequences_per_step`: a group's sequences per optimizer step (micro batch size x gradient
        accumulation); `max_steps` (optimizer steps) caps the epochs. ValueError when n_prompts
        are fewer than one rollout takes."""
        per_group = prompts // groups
        steps_per_rollout = passes * rollout_sequences(per_group, samples_per_prompt) // sequences_per_step
        rollouts_per_epoch = steps_per_epoch(n_prompts, prompts)
        if rollouts_per_epoch == 0:
            raise ValueError(f"{n_prompts} training prompts are fewer than one rollout")
        total_steps = max_steps or epochs * rollouts_per_epoch * steps_per_rollout
        return cls(per_group, groups, steps_per_rollout, rollouts_per_epoch, total_steps,
                   -(-total_steps // steps_per_rollout), n_prompts, prompts, seed)

    def prompt_rows(self, rollout: int, round_: int, group: int) -> tuple[int, ...]:
        """Data-parallel group `group`'s prompts (a process's own, without shared sequences) for
        sampling round `round_` of a rollout: round 0 takes the epoch's order; dynamic sampling's
        later rounds take the same place in orders reshuffled per round, so a resumed run draws
        the same prompts."""
        epoch, position = divmod(rollout, self.rollouts_per_epoch)
        steps = epoch_steps(self.n_prompts, rows_per_step=self.prompts, micro_batch_size=self.prompts_per_group,
                            rank=group, world_size=self.groups, seed=self.seed + 1_000_003 * round_, epoch=epoch)
        return steps[position].micro_batches[0].rows
