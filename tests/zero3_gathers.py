"""Two gloo processes gather a ZeRO-3 model's parameters TRIALS times, a large one and a small
one in one blocking call (DeepSpeed's path for persistent parameters after every step and for
GatheredParameters), and print how many gathers returned other values than rank 0 set.
Run by tests/test_zero3_gathers.py: python tests/zero3_gathers.py TRIALS PORT"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp


def gather(rank: int, port: int, trials: int, wrong) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 2}):
        model = torch.nn.ModuleList([torch.nn.Linear(1024, 2048, bias=False), torch.nn.Linear(2, 1, bias=False)])
    params = list(model.parameters())
    values = [torch.arange(p.ds_numel, dtype=torch.float32).view(p.ds_shape) + 1 for p in params]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            for param, value in zip(params, values):
                param.data.copy_(value)
    count = 0
    for _ in range(trials):
        params[0].all_gather(params)
        count += any(not torch.equal(p.data, v) for p, v in zip(params, values))
        params[0].partition(params)
    wrong[rank] = count
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    trials, port = int(sys.argv[1]), int(sys.argv[2])
    wrong = mp.Manager().dict()
    mp.spawn(gather, args=(port, trials, wrong), nprocs=2)
    print(f"wrong gathers: {max(wrong.values())} of {trials}")
