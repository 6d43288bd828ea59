"""Who am I in the job: rank, world size and master address, from wherever they come.

Three ways a stage is started, each with its own variables:
- a task of a scheduler's job (schedulers/: a submitit job locally or on Slurm, a task of
  slurm/stage.sbatch, a plug-in's): its scheduler's node half knows the tasks and nodes (one
  task per GPU, no torchrun);
- torchrun / deepspeed launcher: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR are set;
- a plain single process: we set the variables for a world of one, since
  DeepSpeed otherwise goes looking for MPI.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta

import schedulers

log = logging.getLogger("stages")


@dataclass(frozen=True)
class DistEnv(schedulers.Layout):
    source: str  # what started this process: its scheduler's node half (e.g. submitit), torchrun, or none (single)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect() -> DistEnv:
    """Read (and export, for torch's env:// rendezvous) the distributed layout."""
    runtime = schedulers.runtime()
    layout = runtime.layout() if runtime is not None else None
    if layout is not None and runtime is not None:  # a layout comes from a runtime
        source = runtime.via
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        source = "torchrun"
        layout = schedulers.Layout(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", 29500)),
        )
    else:
        source = "single"
        layout = schedulers.Layout(0, 1, 0, 1, "127.0.0.1", free_port())
    os.environ.update(
        RANK=str(layout.rank),
        WORLD_SIZE=str(layout.world_size),
        LOCAL_RANK=str(layout.local_rank),
        LOCAL_WORLD_SIZE=str(layout.local_world_size),
        MASTER_ADDR=layout.master_addr,
        MASTER_PORT=str(layout.master_port),
    )
    # DeepSpeed's CPU path asks numactl for the local topology unless told the size.
    os.environ.setdefault("LOCAL_SIZE", str(layout.local_world_size))
    return DistEnv(**asdict(layout), source=source)


def free_port() -> int:
    """A port of this host that nothing listens on now, for a rendezvous of processes started here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_threads(cpus_per_task: int | None, local_processes: int) -> int:
    """torch threads of each process of a stage on the CPU: cluster.cpus_per_task, 1 when the
    pipeline file does not say. Never the machine's core count (nor its load): torch's
    element-wise kernels (silu, sigmoid, gelu...) give each thread one chunk of a tensor and
    finish each chunk's ragged end with scalar code that rounds differently from the vector
    loop, so the thread count changes a stage's numbers (the tiny chain's RM eval margin:
    7.870 on 1 thread, 7.896 on 2). The same file trains to the same numbers on any machine
    of one CPU kind. A file that asks for more cores than this machine gives its processes
    (a GPU node's file run as a scale model on a small machine) gets what there is, and the
    log says so: threads beyond the cores only wait on each other."""
    wanted = cpus_per_task or 1
    available = max(1, len(os.sched_getaffinity(0)) // max(1, local_processes))
    if wanted > available:
        log.warning("cluster.cpus_per_task is %d, but this machine has %d core(s) for each of its %d processes: "
                    "%d torch thread(s) each", wanted, available, local_processes, available)
        return available
    return wanted


def init(env: DistEnv, gpus_per_node: int, timeout_s: int = 600, threads: int = 1):
    """Start torch.distributed through DeepSpeed: NCCL on GPUs, gloo on CPU, where each process
    computes with `threads` torch threads (cpu_threads says how many). Returns the device.

    A job that asked for GPUs fails here when it finds none, rather than train on the CPU."""
    # Packed micro batches change shape every pass: with fixed-size cached blocks the
    # allocator keeps freeing and re-reserving GPU memory (cudaFree synchronises). Growable
    # segments avoid it: a packed 1B SFT on an H100 went from 11.5k to 13.0k tokens/s.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from stages import compat, deepspeed_ops

    compat.normalize_arch_list_env()  # before DeepSpeed builds any op
    deepspeed_ops.prepare()
    import deepspeed
    import torch

    if gpus_per_node:
        problem = missing_gpus(1)  # per task: a site may bind one GPU to each
        if problem:
            raise RuntimeError(f"stage task on {socket.gethostname()} asked for GPUs (cluster.gpus_per_node: "
                               f"{gpus_per_node}), but {problem}; it does not fall back to the CPU")
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
        # Batches change shape every pass (packed lines, or padding to the longest row), and
        # sdpa's cuDNN backend builds a new graph for every new shape: on an H100 the steps
        # that met new shapes took 2-3x as long (benchmarks/RESULTS.md). Memory-efficient
        # attention (masks) and flash attention (none) need no per-shape build. (Before torch
        # 2.2 sdpa had no cuDNN backend.)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
    else:
        torch.set_num_threads(threads)
        device, backend = torch.device("cpu"), "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    if backend == "gloo":
        # Every rank maps every rank's shared-memory allreduce buffer inside
        # init_distributed; once all are past it the names can go, so a killed
        # (preempted, failed) process leaves nothing behind in /dev/shm.
        import torch.distributed as dist

        dist.barrier()
        compat.remove_cpu_comm_buffer()
    return device


def missing_gpus(asked: int) -> str | None:
    """What keeps this process from using `asked` GPUs, as torch sees them; None when nothing does.

    The one place that says it: a stage task checks itself with it, and `validate` / `run` ask
    it in a child process of the same python before a local run (the pipeline stays torch-free)."""
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return f"torch {torch.__version__} has no CUDA support"
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "unset" if visible is None else repr(visible)
        return f"no CUDA device visible (CUDA_VISIBLE_DEVICES={where})"
    if found < asked:
        return f"{found} visible, {asked} asked"
    return None


def devices(device, world_size: int) -> dict:
    """What the job trains on, for the log and result.json: the device type, its model, and how
    many over the whole job (one per process); on the CPU also each process's torch threads,
    which its numbers depend on."""
    import torch

    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "count": world_size}
    return {"type": "cpu", "name": cpu_model(), "count": world_size, "threads": torch.get_num_threads()}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    from stages import compat

    compat.remove_cpu_comm_buffer()  # DeepSpeed on CPU leaves ~70 MB per process in /dev/shm
