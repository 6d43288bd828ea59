"""Sums over processes say what they count (stages/collectives.py): numbers a sequence-sharing group
holds alike count once per group, each process's own count on every process. Four gloo processes
in two sharing groups of two, the layout stages/sequence_parallel.py forms (consecutive ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, SHARING = 4, 2
GiB = 2**30


def _in_two_sharing_groups(rank: int, folder: str) -> None:
    from stages import collectives, engine, sequence_parallel, tracking

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    sequence_parallel._layout = sequence_parallel.Layout(SHARING, rank % SHARING, rank // SHARING, WORLD // SHARING)
    group = rank // SHARING
    held_alike = [10.0 * (group + 1), 1.0]  # the same on both processes of a group: its loss, its one sequence
    own = [float(rank + 1)]  # this process's own number
    as_tensor = torch.tensor(held_alike, dtype=torch.float64)
    out = {"once_per_group": collectives.sum_once_per_group(held_alike),
           "each_process": collectives.sum_each_process(own),
           "once_per_group_tensor": collectives.sum_once_per_group(as_tensor).tolist(),
           "largest": collectives.largest_of_any_process(torch.tensor(own)).tolist()}
    # A metrics record: the group's loss share (alike in a group), each process's own host memory.
    tracking.host_rss_bytes = lambda: (rank + 1) * GiB
    ctx = SimpleNamespace(device=torch.device("cpu"), on_gpu=False, world_size=WORLD,
                          task=SimpleNamespace(processes_per_node=WORLD, stage=None))
    window = engine.Window(ctx)
    window.add(SimpleNamespace(real_tokens=8, processed_tokens=10), {"loss": torch.tensor(held_alike[0])}, 0.0)
    record = window.close(steps=1)
    out["record"] = {key: record[key] for key in ("loss", "host_rss_gib", "token_efficiency")}
    Path(folder, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_group_numbers_count_once_per_sharing_group_and_own_numbers_on_every_process(tmp_path):
    mp.spawn(_in_two_sharing_groups, args=(str(tmp_path),), nprocs=WORLD)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD)]
    assert all(result == results[0] for result in results)  # every process has the same sums
    got = results[0]
    assert got["once_per_group"] == got["once_per_group_tensor"] == [10.0 + 20.0, 2.0]  # two groups, one sequence each
    assert got["each_process"] == [1.0 + 2.0 + 3.0 + 4.0]
    assert got["largest"] == [4.0]
    # The record: the two groups' losses; the host memory of all four processes on the one node.
    assert got["record"] == {"loss": 30.0, "host_rss_gib": 10.0, "token_efficiency": 0.8}
