"""What `python -m pipeline calibrate` measures on a node: matmul rates at the pipeline's shapes,
GPU memory and host<->GPU copy bandwidth, one process's CPU Adam rate and host work of a whole
offloaded optimizer step, NCCL collective bandwidth.

pipeline/calibrate.py decides what to measure (a Request) and calls `measure` here, in its own
process or in a Slurm job; `measure` returns the calibration file's content as
core/calibration.py defines it. Each measurement is one function with its own bound (a
time budget, repeats, or a timeout); the GPU ones time with CUDA events around many calls.

Torch is imported inside the functions: the login node imports this module to submit the job.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import statistics
import time
from dataclasses import asdict

from core import calibration
from core.errors import InvalidInput
from core.hardware import gpu_for_device
from stages.distributed import free_port

# A timed sample is this many calls of a product, at least this long (seconds), so that the
# launch overhead of a small GEMM does not count as its speed.
SAMPLE_S = 0.02
MAX_CALLS = 1000
GiB = 2**30
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The stages' AdamW settings (core/config.py defaults): the same work per parameter.
ADAM = {"lr": 1e-5, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


def measure(request) -> dict:
    """Everything the request asks for that this machine has: the calibration file's content."""
    import torch

    from stages import compat, deepspeed_ops

    on_gpu = torch.cuda.is_available()
    if request.require_gpu and not on_gpu:
        raise InvalidInput(f"no CUDA GPU visible on {socket.gethostname()} (torch {torch.__version__}, "
                           f"CUDA {torch.version.cuda or 'none'}): GPU rates cannot be measured without a GPU. "
                           "Run on a GPU node, or with --slurm; without --require-gpu only the CPU is measured")
    compat.normalize_arch_list_env()  # before DeepSpeed builds CPU Adam
    deepspeed_ops.prepare()  # and says so when it does
    sizes, notes, timed = request.sizes, [], _Timer()
    cores = len(os.sched_getaffinity(0))
    per_process = max(1, cores // request.processes_per_node)
    if cores < request.processes_per_node:
        notes.append(f"{cores} cores for {request.processes_per_node} processes per node: each process gets one")
    gpu = _gpu_rates(request, timed, notes) if on_gpu else _no_gpu(notes)
    cpu_adam = timed("cpu_adam", cpu_adam_rate, per_process, sizes.cpu_adam_params, sizes.cpu_adam_steps,
                     sizes.cpu_adam_budget_s, notes)
    offload_step = timed("offload_step", offload_step_rate, request.offload, per_process, sizes.offload_steps,
                         on_gpu, gpu["host_to_gpu_gbs"], notes)
    return {
        "version": calibration.VERSION,
        "node": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu["gpu"],
        "cores_available": cores,
        "cores_per_process": per_process,
        "processes_per_node": request.processes_per_node,
        "versions": {"torch": torch.__version__, "deepspeed": _version("deepspeed"), "cuda": torch.version.cuda},
        "matmul": gpu["matmul"],
        "memory_bandwidth_gbs": gpu["memory_bandwidth_gbs"],
        "host_to_gpu_gbs": gpu["host_to_gpu_gbs"],
        "gpu_to_host_gbs": gpu["gpu_to_host_gbs"],
        "cpu_adam": cpu_adam,
        "collective": gpu["collective"],
        "offload_step": offload_step,
        "settings": asdict(sizes),
        "seconds": timed.seconds,
        "notes": notes,
    }


class _Timer:
    """Runs one measurement and keeps its wall-clock seconds under its name."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name, function, *args):
        start = time.perf_counter()
        value = function(*args)
        self.seconds[name] = round(time.perf_counter() - start, 2)
        return value


def _gpu_rates(request, timed: _Timer, notes: list[str]) -> dict:
    """GPU 0 (what it is), its matmul rates, memory bandwidth and host copies, and the collectives
    over every visible GPU."""
    import torch

    sizes = request.sizes
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    entry = gpu_for_device(props.name)
    gpu = {"device_name": props.name, "catalogue": entry.name if entry else None,
           "count": torch.cuda.device_count(), "memory_gib": round(props.total_memory / GiB, 1)}
    if entry is None:
        notes.append(f"{props.name} is not in core/hardware.py's catalogue: `plan` cannot name it as "
                     "cluster.gpu, so it does not read this file")
    matmul = timed("matmul", matmul_rates, request.gemms, device, sizes.matmul_repeats, sizes.matmul_budget_s,
                   notes)
    memory = timed("memory_bandwidth", memory_bandwidth_gbs, device, sizes.copy_bytes, sizes.copy_repeats)
    h2d, d2h = timed("host_copies", host_copy_gbs, device, sizes.copy_bytes, sizes.copy_repeats)
    collective = None
    if gpu["count"] > 1:
        collective = timed("collective", collective_rates, gpu["count"], "nccl", sizes.collective_bytes,
                           sizes.collective_repeats, sizes.collective_timeout_s, notes)
    else:
        notes.append("one GPU visible: no collective to measure (collective is null)")
    return {"gpu": gpu, "matmul": matmul, "memory_bandwidth_gbs": memory, "host_to_gpu_gbs": h2d,
            "gpu_to_host_gbs": d2h, "collective": collective}


def _no_gpu(notes: list[str]) -> dict:
    """The GPU rates of a machine without one: null, and a note that says why."""
    notes.append(f"no CUDA GPU visible on {socket.gethostname()}: GPU rates cannot be measured without a GPU, "
                 "so matmul, memory, host copy and collective are null; only the CPU's rates (CPU Adam, the "
                 "offloaded optimizer step) were measured")
    return {"gpu": None, "matmul": [], "memory_bandwidth_gbs": None, "host_to_gpu_gbs": None,
            "gpu_to_host_gbs": None, "collective": None}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _figures(rate: float) -> float:
    """A measured rate to 4 significant figures (more would be noise), never rounded to 0."""
    return float(f"{rate:.4g}")


def _median_seconds(run, device, repeats: int, calls: int = 1) -> float:
    """The median time of `calls` calls of `run`, over `repeats` samples after one warm-up call:
    CUDA events on a GPU (the device's own clock, no host overhead), perf_counter on a CPU."""
    import torch

    run()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000)
        else:
            start_s = time.perf_counter()
            for _ in range(calls):
                run()
            samples.append(time.perf_counter() - start_s)
    return statistics.median(samples) / calls


def gemm_tflops(m: int, k: int, n: int, dtype: str, layout: str, device, repeats: int) -> float:
    """TFLOP/s of C[m, n] = A[m, k] @ B[k, n] with operands laid out as `layout` says ("nn";
    "nt": B stored as [n, k], as nn.Linear's weight; "tn": A stored as [k, m])."""
    import torch

    kind = getattr(torch, DTYPES[dtype])
    a = torch.randn((k, m) if layout == "tn" else (m, k), device=device, dtype=kind)
    b = torch.randn((n, k) if layout == "nt" else (k, n), device=device, dtype=kind)
    a = a.t() if layout == "tn" else a
    b = b.t() if layout == "nt" else b
    out = torch.empty(m, n, device=device, dtype=kind)

    def run():
        torch.matmul(a, b, out=out)

    once = _median_seconds(run, device, 1)  # the first call also picks cuBLAS's kernel
    calls = min(MAX_CALLS, max(1, math.ceil(SAMPLE_S / max(once, 1e-9))))
    return 2 * m * k * n / _median_seconds(run, device, repeats, calls) / 1e12


def matmul_rates(gemms, device, repeats: int, budget_s: float, notes: list) -> list[dict]:
    """Each GEMM's rate (calibration.MatmulRate fields); none starts after `budget_s` seconds, and
    one that does not fit in memory is left out with a note."""
    import torch

    deadline = time.monotonic() + budget_s
    rates = []
    for index, gemm in enumerate(gemms):
        if time.monotonic() > deadline:
            notes.append(f"matmul: {len(gemms) - index} of {len(gemms)} GEMMs not measured: the {budget_s:.0f} s "
                         "budget ran out")
            break
        try:
            tflops = gemm_tflops(gemm.m, gemm.k, gemm.n, gemm.dtype, gemm.layout, device, repeats)
        except torch.cuda.OutOfMemoryError:
            notes.append(f"matmul {gemm.what} of {gemm.model} ({gemm.m}x{gemm.k}x{gemm.n} {gemm.dtype}) does not fit "
                         "in GPU memory: not measured")
            torch.cuda.empty_cache()
            continue
        rates.append({"what": gemm.what, "model": gemm.model, "m": gemm.m, "k": gemm.k, "n": gemm.n,
                      "dtype": gemm.dtype, "tflops": _figures(tflops)})
    if device.type == "cuda":  # hand the operands' cached blocks back: the collective's processes need GPU 0 too
        torch.cuda.empty_cache()
    return rates


def memory_bandwidth_gbs(device, nbytes: int, repeats: int) -> float:
    """A device-to-device copy of nbytes: bytes read + bytes written per second (GB/s), the bytes
    the planner's memory-bound terms count."""
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return _figures(2 * nbytes / _median_seconds(lambda: target.copy_(source), device, repeats) / 1e9)


def host_copy_gbs(device, nbytes: int, repeats: int) -> tuple[float, float]:
    """Copies of nbytes between pinned host memory (as DeepSpeed's offload pins it) and the GPU:
    (host -> GPU, GPU -> host) in GB/s."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up = _median_seconds(lambda: gpu.copy_(host, non_blocking=True), device, repeats)
    down = _median_seconds(lambda: host.copy_(gpu, non_blocking=True), device, repeats)
    return _figures(nbytes / up / 1e9), _figures(nbytes / down / 1e9)


def cpu_adam_rate(threads: int, params: int, steps: int, budget_s: float, notes: list) -> dict:
    """One process stepping `params` fp32 parameters with DeepSpeed's CPU Adam (what a stage with
    optimizer_offload steps on the host) on `threads` threads: parameters per second, the median
    of `steps` steps (fewer when they would take over budget_s) after a warm-up step that
    allocates m and v. Where DeepSpeedCPUAdam cannot be built, torch's AdamW (foreach) instead."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # DeepSpeed's op runs on torch's OpenMP runtime (the same libgomp)
    try:
        weights = torch.nn.Parameter(torch.empty(params).normal_(0, 0.02))
        weights.grad = torch.empty(params).normal_(0, 1e-3)
        optimizer, name = _cpu_optimizer(weights, notes)
        start = time.perf_counter()
        optimizer.step()
        first = time.perf_counter() - start
        count = max(1, min(steps, int(budget_s / max(first, 1e-9))))
        seconds = _median_seconds(optimizer.step, torch.device("cpu"), count)
    finally:
        torch.set_num_threads(previous)
    return {"params_per_s": _figures(params / seconds), "optimizer": name, "threads": threads, "params": params}


# Host bytes per parameter of an offloaded step (fp32 master, m, v and gradient, the staging copy, the
# weights): a slice that needs more than half the free memory is not measured.
OFFLOAD_HOST_BYTES_PER_PARAM = 24
OFFLOAD_SEQUENCE = 64  # tokens of the one micro batch whose gradients each timed step applies


def offload_step_rate(offload, threads: int, steps: int, on_gpu: bool, h2d_gbs: float | None,
                      notes: list) -> dict | None:
    """DeepSpeed's own offloaded optimizer step, as a stage with optimizer_offload configures it
    (engine.deepspeed_config, engine.initialize), over `offload`'s slice (pipeline/calibrate.py
    OffloadSlice) in one process on `threads` threads: its parameters per second of the step's host
    work, the median of `steps` steps after a warm-up one; on a GPU the upload of the new weights
    (at the measured host->GPU rate) is taken out, as the plan counts it apart. None, noted, where
    the slice cannot be measured."""
    if offload is None:
        notes.append("the offloaded optimizer step was not measured: the config.json of the file's model is not "
                     "on this machine; the plan keeps the records' host rate")
        return None
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if offload.params * OFFLOAD_HOST_BYTES_PER_PARAM > free // 2:
        notes.append(f"the offloaded optimizer step was not measured: {offload.layers} layer(s) of {offload.model} "
                     f"need {offload.params * OFFLOAD_HOST_BYTES_PER_PARAM / GiB:.0f} GiB of host memory, "
                     f"{free / GiB:.0f} GiB is free")
        return None
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step_s = _offloaded_step_seconds(offload, steps, on_gpu)
    finally:
        torch.set_num_threads(previous)
    bytes_per_weight = 4 if offload.precision == "fp32" else 2
    copies_s = offload.params * bytes_per_weight / (h2d_gbs * 1e9) if on_gpu and h2d_gbs else 0.0
    return {"params_per_s": _figures(offload.params / max(step_s - copies_s, 1e-9)), "model": offload.model,
            "layers": offload.layers, "params": offload.params, "zero_stage": offload.zero_stage, "threads": threads,
            "step_s": _figures(step_s), "copies_s": round(copies_s, 6)}


def _offloaded_step_seconds(offload, steps: int, on_gpu: bool) -> float:
    """The median ds.step() of the slice, one process of its own process group."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.schemas.sft import SFTStage
    from stages import compat, engine

    single = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
              "WORLD_SIZE": "1", "LOCAL_SIZE": "1"}
    saved = {name: os.environ.get(name) for name in single}
    os.environ.update(single)
    ds = None
    try:
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
        config = dict(offload.config)
        built = AutoConfig.for_model(config.pop("model_type"), **config)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(built).to(getattr(torch, DTYPES[offload.precision]))
        stage = SFTStage.model_validate({
            "name": "calibrate", "kind": "sft", "model": offload.model, "data": {"path": "builtin:digits"},
            "precision": offload.precision, "zero_stage": offload.zero_stage, "optimizer_offload": True,
            "micro_batch_size": 1, "max_len": OFFLOAD_SEQUENCE})
        ds_config = engine.deepspeed_config(stage, 1, built.hidden_size, on_gpu, offload.params)
        ds = engine.initialize(model, stage, ds_config, total_steps=steps + 1)
        ids = torch.randint(0, built.vocab_size, (1, OFFLOAD_SEQUENCE), device=ds.device)
        seconds = []
        for _ in range(steps + 1):  # the first allocates Adam's m and v
            ds.backward(ds(input_ids=ids, labels=ids).loss)
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            ds.step()
            if on_gpu:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[1:])
    finally:
        if ds is not None and hasattr(ds, "destroy"):
            ds.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
        if not on_gpu:
            compat.remove_cpu_comm_buffer()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _cpu_optimizer(weights, notes: list):
    """DeepSpeedCPUAdam over `weights` (JIT-built where neither the installed DeepSpeed nor the
    extensions folder holds it: a minute or more, said and noted), else torch's AdamW with a note
    saying why."""
    import torch

    from stages import deepspeed_ops

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam([weights], adamw_mode=True, **ADAM)
    except Exception as err:  # noqa: BLE001 -- no compiler, no DeepSpeed: measure what can be
        reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        notes.append(f"DeepSpeedCPUAdam could not be loaded ({reason}): measured torch.optim.AdamW (foreach), "
                     "which is slower than what a stage with optimizer_offload steps with")
        return torch.optim.AdamW([weights], foreach=True, **ADAM), "torch.optim.AdamW (foreach)"
    if "cpu_adam" in deepspeed_ops.built_here():
        notes.append(f"DeepSpeedCPUAdam was JIT-built first ({deepspeed_ops.built_here()['cpu_adam']:.0f} s, not "
                     f"counted in its rate); kept in {deepspeed_ops.extensions_dir()} for the stages and the next "
                     "calibration")
    return optimizer, "DeepSpeedCPUAdam"


def collective_rates(world: int, backend: str, nbytes: int, repeats: int, timeout_s: float,
                     notes: list) -> dict | None:
    """All-gather and reduce-scatter bus bandwidth between `world` processes, one per GPU (nccl),
    spawned here (calibration.CollectiveRate fields). None, with a note, when they fail or do not
    finish within timeout_s (they are stopped then)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()  # the processes' rendezvous
    processes = mp.start_processes(_collective_process, args=(world, backend, port, nbytes, repeats, results),
                                   nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not processes.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                notes.append(f"collective: the {world} processes did not finish within {timeout_s:.0f} s: "
                             "stopped, not measured")
                return None
    except Exception as err:  # noqa: BLE001 -- a process failed (NCCL, memory): say so, keep the rest
        reason = next((line for line in reversed(str(err).splitlines()) if line.strip()), type(err).__name__)
        notes.append(f"collective: a process failed ({reason.strip()}): not measured")
        return None
    finally:
        for process in processes.processes:
            if process.is_alive():
                process.kill()
    return results.get()


def _collective_process(rank: int, world: int, backend: str, port: int, nbytes: int, repeats: int,
                        results) -> None:
    """One process of collective_rates: time both collectives on a tensor of nbytes (bf16 on GPUs,
    fp32 on CPUs); rank 0 puts the rates on `results`."""
    import torch
    import torch.distributed as dist

    from stages import compat

    all_gather, reduce_scatter = compat.tensor_collectives()
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device, dtype = torch.device("cuda", rank), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        per_rank = max(1, nbytes // dtype.itemsize // world)
        full = torch.zeros(per_rank * world, dtype=dtype, device=device)
        shard = torch.zeros(per_rank, dtype=dtype, device=device)
        moved = full.numel() * full.element_size() * (world - 1) / world
        rates = {"processes": world, "bytes": full.numel() * full.element_size()}
        for key, run in (("all_gather_gbs", lambda: all_gather(full, shard)),
                         ("reduce_scatter_gbs", lambda: reduce_scatter(shard, full))):
            dist.barrier()
            rates[key] = _figures(moved / _median_seconds(run, device, repeats) / 1e9)
        if rank == 0:
            results.put(rates)
    finally:
        dist.destroy_process_group()
