"""Sums (and the largest value) over a stage's processes, each named for what it counts.

Processes that share sequences (sequence_parallel N: stages/sequence_parallel.py) hold the same
numbers for their group's rows: every one of the N computes the same losses, token counts and
rollout statistics. Summed over every process, those would count each group N times. A process's
own numbers (its memory, whether its shard of the weights is finite) differ within a group, and
each counts. So a sum says which it adds:

- `sum_once_per_group`: numbers every process of a sharing group holds alike; each group counts
  once (its first process's numbers);
- `sum_each_process`: numbers of each process's own; every process counts.

Without sharing (groups of one process) both are the same sum. Each takes a list of numbers and
gives a list of floats, or takes a tensor (on the device the backend reduces on: NCCL's GPU) and
sums it in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from stages import sequence_parallel

Numbers = TypeVar("Numbers", bound=Sequence[float] | torch.Tensor)


def sum_once_per_group(values: Numbers) -> Numbers:
    """Summed over the sequence-sharing groups, each group's once: a list gives a list, a tensor
    is summed in place."""
    tensor = _as_tensor(values)
    if sequence_parallel.layout().rank:  # the group's first process holds the same numbers: it counts them
        tensor.zero_()
    dist.all_reduce(tensor)
    return cast(Numbers, tensor if isinstance(values, torch.Tensor) else tensor.tolist())


def sum_each_process(values: Numbers) -> Numbers:
    """Summed over every process: a list gives a list, a tensor is summed in place."""
    tensor = _as_tensor(values)
    dist.all_reduce(tensor)
    return cast(Numbers, tensor if isinstance(values, torch.Tensor) else tensor.tolist())


def largest_of_any_process(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's largest value of every process, in place (where it lies: NCCL reduces GPU tensors)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def _as_tensor(values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    tensor = torch.tensor(list(values), dtype=torch.float64)
    return tensor.cuda() if dist.get_backend() == "nccl" else tensor
