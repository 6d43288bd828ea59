"""The training engine every stage shares: DeepSpeed config and start-up, the
training loop, metrics and the optimizer step (checkpoints: stages/checkpoints.py; export to Hugging Face
format: stages/export.py).

Every trainable stage runs on one loop (`run`): resume, metrics, the log, eval and
save intervals, save-and-requeue at a signal, the phases the hang watchdog times
(stages/watchdog.py) and progress are the same for every stage, which is what makes resume and
metrics uniform. A stage brings only its unit of work (`Work`): a supervised stage hands `train` a loss on one micro
batch, an evaluation and its micro batches (`Loop`); RL hands `run` its rollout and
update (stages/ppo.py).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from core import batching
from core import metrics as records
from core.batching import accumulation_steps
from core.checkpoints import newest_intact
from core.deepspeed_settings import bucket_elements, offloads_optimizer, persistence_threshold, reduce_bucket_elements
from core.errors import Diverged, InvalidInput
from stages import collectives, preemption, tracking, watchdog
from stages.checkpoints import Checkpoints

log = logging.getLogger("stages")

# --------------------------------------------------------------------------- config


def gradient_accumulation(stage, world_size: int) -> int:
    return accumulation_steps(stage.global_batch_size, stage.micro_batch_size, stage.data_parallel(world_size))


def sequences_per_step(stage, world_size: int) -> int:
    """Sequences one process trains on in one optimizer step (its micro batches of one step)."""
    return stage.micro_batch_size * gradient_accumulation(stage, world_size)


def deepspeed_config(stage, world_size: int, hidden_size: int, on_gpu: bool, trained: int | None = None) -> dict:
    """The DeepSpeed config for a stage spec; every number traceable to a spec field. `trained`: the
    parameters the stage trains, when known (its gradient buckets are no larger: LoRA).

    DeepSpeed sees every process as data-parallel, sequence-sharing ones too (their gradients
    are averaged like any other's: stages/sequence_parallel.py), so its batch size counts every
    process; the rows of a step are micro_batch_size x accumulation x the data-parallel processes."""
    accumulation = gradient_accumulation(stage, world_size)
    zero: dict = {"stage": stage.zero_stage}
    if stage.zero_stage >= 1:
        bucket = bucket_elements(on_gpu)
        zero.update(
            reduce_bucket_size=reduce_bucket_elements(on_gpu, trained),
            allgather_bucket_size=bucket,
            overlap_comm=on_gpu,
            contiguous_gradients=True,
        )
    if stage.zero_stage == 3:
        zero.update(
            stage3_param_persistence_threshold=persistence_threshold(hidden_size),
            stage3_prefetch_bucket_size=bucket,
            stage3_gather_16bit_weights_on_model_save=False,
        )
    offloads = offloads_optimizer(stage.optimizer_offload, stage.zero_stage)
    if offloads:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    adam = {"lr": stage.learning_rate, "betas": list(stage.betas), "eps": 1e-8, "weight_decay": stage.weight_decay}
    if not offloads:
        # torch's AdamW (fused into one kernel on GPU), not DeepSpeed's FusedAdam, which nvcc
        # compiles at the first step on every fresh node. Offload steps with DeepSpeed's CPU Adam.
        adam["torch_adam"] = True
        if on_gpu:
            adam["fused"] = True
    config = {
        "train_micro_batch_size_per_gpu": stage.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": stage.micro_batch_size * accumulation * world_size,
        "gradient_clipping": stage.max_grad_norm,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": adam},
        "bf16": {"enabled": stage.precision == "bf16"},
        "fp16": {"enabled": stage.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return config


def frozen_model_config(stage, world_size: int, hidden_size: int, on_gpu: bool, offload: bool) -> dict:
    """DeepSpeed config for a model that is only consulted (a reference or reward model):
    ZeRO-3 shards it like the policy, and offload keeps its parameters in host RAM."""
    zero: dict = {"stage": 3 if stage.zero_stage == 3 else 0}
    if stage.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = persistence_threshold(hidden_size)
        if offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    return {
        "train_micro_batch_size_per_gpu": stage.micro_batch_size,
        "train_batch_size": stage.micro_batch_size * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": stage.precision == "bf16"},
        "fp16": {"enabled": stage.precision == "fp16"},
        "steps_per_print": 10**9,
    }


def step_counts(n_rows: int, rows_per_step: int, stage) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps) for n_rows training rows (after
    tokenising: rows left with nothing to learn within max_len are gone) taken rows_per_step
    at a time. Preflight counted the rows before that; fewer than one step is refused here,
    never trained on."""
    steps_per_epoch = batching.steps_per_epoch(n_rows, rows_per_step)
    if steps_per_epoch == 0:
        raise InvalidInput(
            f"stage '{stage.name}': {stage.data.path}: {n_rows} training rows are left after tokenising (rows with "
            f"nothing to learn within max_len {stage.max_len} are dropped), fewer than one optimizer step needs "
            f"({rows_per_step}: micro_batch_size x gradient accumulation x processes). Give more rows, raise max_len, "
            f"or lower micro_batch_size or global_batch_size")
    return steps_per_epoch, stage.max_steps or stage.epochs * steps_per_epoch


def learning_rate_factor(stage, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak rate at optimizer step s: linear warm-up, then the schedule."""
    warmup = min(stage.warmup_steps, max(total_steps - 1, 0))
    floor = stage.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if stage.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if stage.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@watchdog.phase(watchdog.LOADING)
def initialize(model, stage, ds_config: dict, total_steps: int):
    """deepspeed.initialize with AdamW (no decay on norms and biases) and the LR schedule."""
    import deepspeed

    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": stage.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    factor = learning_rate_factor(stage, total_steps)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[g for g in groups if g["params"]],
        # A copy: DeepSpeed 0.13 pops `torch_adam` from the config it is given, so a second engine
        # built from the same one (PPO's critic) stepped with DeepSpeed's FusedAdam, an op it
        # JIT-compiles at start-up (nvcc on a GPU node, ~2 min of g++ on a CPU).
        config=copy.deepcopy(ds_config),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
    )
    return engine


# --------------------------------------------------------------------------- metrics


# Metrics (metrics.jsonl, TensorBoard, W&B, the progress line) live in stages/tracking.py.
Metrics = tracking.Metrics


# --------------------------------------------------------------------------- the loop


class Work(Protocol):
    """What the loop (`run`) advances, one unit at a time: a supervised stage's optimizer step
    (`OptimizerSteps`), or an RL rollout and its update (stages/ppo.py: several optimizer steps).

    Unit u ends at optimizer step min(total_steps, (u + 1) x steps_per_unit): metrics, the
    intervals, checkpoints and the schedule count optimizer steps; resume and signals act
    between units.
    """

    engine: object  # the DeepSpeed engine whose checkpoint `latest` names
    others: dict  # engines saved inside the same checkpoint (name -> engine), e.g. a critic
    total_steps: int
    steps_per_unit: int
    log_interval: int  # optimizer steps between training records (and after the last unit)

    def advance(self, unit: int, window: Window) -> None:
        """Train unit `unit` (0-based), adding what it trained on to the window."""

    def record(self) -> dict:
        """The stage's numbers for the training record after the unit just advanced."""

    def evaluate(self) -> dict:
        """Evaluation metrics (names without `eval_`), the same on every rank."""

    def state(self) -> dict:
        """What a checkpoint keeps besides the engines, the step and the initial evaluation."""

    def resume(self, state: dict) -> None:
        """Take back `state()` from a checkpoint."""


def crossed(interval: int, previous: int, step: int) -> bool:
    """Whether a unit that took the optimizer steps from `previous` to `step` reached a multiple
    of `interval` (0: never): the one rule for the log, eval and save intervals."""
    return bool(interval) and step // interval > previous // interval


def run(work: Work, stage, ctx) -> dict:
    """Run (or resume) the units of `work`; returns initial and final eval metrics and the steps."""
    checkpoints = Checkpoints(ctx.folder, stage.keep_checkpoints, ctx.is_main, ctx.rank)
    metrics = Metrics(ctx, work.total_steps)

    numbers = Numbers(stage, checkpoints, work)
    state = checkpoints.load(work.engine, work.others)
    if state is None:
        start_step = 0
        initial = _evaluate(work, 0)
        metrics.truncate_after(-1)
        metrics.write(_evaluation(0, initial))
        numbers.evaluated(0, initial)
    else:
        start_step = state["step"]
        # An RL checkpoint from before this loop kept its initial evaluation under its own name.
        initial = state["initial_eval"] if "initial_eval" in state else {"reward": state["initial_reward"]}
        work.resume(state)
        metrics.truncate_after(start_step)

    with preemption.Signals(ctx) as signals:
        loop_started = time.time()
        step = _units(work, stage, ctx, checkpoints, metrics, numbers, signals, initial, start_step)
        log.info(signals.cost_line(time.time() - loop_started))

    final = _evaluate(work, step)
    metrics.write(_evaluation(step, final))
    numbers.evaluated(step, final)
    numbers.before_exporting(step)  # the stage exports when this returns
    metrics.close()
    return {"initial": initial, "final": final, "steps": step}


def _units(work, stage, ctx, checkpoints, metrics, numbers, signals, initial, start_step: int) -> int:
    """The units after `start_step`; at a signal, save and requeue (never returns then)."""

    def save(step: int, client_state: dict) -> None:
        numbers.before_saving(logged, step)
        with watchdog.phase(watchdog.SAVING, step=step):
            checkpoints.save(work.engine, step, client_state, work.others)

    window = Window(ctx)
    step = logged = saved = start_step
    per_unit = work.steps_per_unit
    for unit in range(-(-start_step // per_unit), -(-work.total_steps // per_unit)):
        unit_started = time.time()
        with watchdog.phase(watchdog.TRAINING_STEP, step=step + 1):
            work.advance(unit, window)
        unit_s = time.time() - unit_started
        previous, step = step, min(work.total_steps, (unit + 1) * per_unit)
        last = step == work.total_steps
        if crossed(work.log_interval, previous, step) or last:
            # The first window after a resume may be short: it starts at the resumed step.
            record = {"step": step, **window.close(step - logged), **work.record()}
            metrics.write(record)
            numbers.recorded(logged, record)
            logged = step
        paused = time.time()  # evaluation and saving are not training time
        if crossed(stage.eval_interval, previous, step) and not last:
            evaluation = _evaluate(work, step)
            metrics.write(_evaluation(step, evaluation))
            numbers.evaluated(step, evaluation)
        client_state = {"step": step, "initial_eval": initial, **work.state()}
        # The last step is saved too: a job stopped in the final evaluation or the export
        # resumes there, not save_interval steps back, and the export can be checked against it.
        if stage.save_interval and (crossed(stage.save_interval, previous, step) or last):
            save(step, client_state)
            saved = step
        signal_name = signals.requested(unit + 1, unit_s, last=last)
        if signal_name:
            metrics.close()
            at_signal = {**client_state, "signal": signal_name}
            signals.save_and_requeue(signal_name, step, None if saved == step else
                                       lambda step=step, state=at_signal: save(step, state))
        window.started += time.time() - paused
    return step


def _evaluate(work: Work, step: int) -> dict:
    with watchdog.phase(watchdog.EVALUATION, step=step):
        return work.evaluate()


def _evaluation(step: int, results: dict) -> dict:
    return {"step": step, **{f"eval_{k}": v for k, v in results.items()}}


def _steps(since: int, step: int) -> str:
    return f"step {step}" if step == since + 1 else f"steps {since + 1}-{step}"


class Numbers:
    """Stops a stage whose weights stopped being numbers (nan or inf), before they are saved,
    exported or handed to the next stage, and says in which steps and what to change.

    The weights (each process's share, every trained model's) are looked at before every save,
    before the export, and at every training record whose losses or gradient norms are not
    numbers: DeepSpeed skips some steps whose gradients are not (fp16's loss scaling always; some
    versions in bf16 and fp32 too), and then the weights are intact and training goes on. An
    evaluation whose losses are not numbers stops the stage too. Every rank decides alike: records
    and evaluations are the same on every rank, and the look at the weights is a collective."""

    def __init__(self, stage, checkpoints: Checkpoints, work):
        self.stage, self.checkpoints = stage, checkpoints
        self.engines = [work.engine, *work.others.values()]
        self.finite_at: int | None = None  # the step whose weights were last found numbers

    def recorded(self, since: int, record: dict) -> None:
        """A training record of the steps after `since`."""
        bad = records.not_finite(record)
        if not bad:
            return
        steps = _steps(since, record["step"])
        self._look(record["step"], f"{self._values(bad, record)} in {steps}, and the weights are no longer numbers")
        log.warning("%s: %s; the weights are still numbers (DeepSpeed skipped %d step(s) in all whose gradients "
                    "were not), so training goes on", steps, self._values(bad, record), self.engines[0].skipped_steps)

    def before_saving(self, since: int, step: int) -> None:
        self._look(step, f"the weights stopped being numbers in {_steps(since, step)} "
                         f"(found before saving step {step})")

    def before_exporting(self, step: int) -> None:
        self._look(step, f"the weights at step {step} are not numbers (found before exporting them)")

    def evaluated(self, step: int, results: dict) -> None:
        bad = records.not_finite(results)
        if not bad:
            return
        if step == 0:
            raise Diverged(
                f"the model this stage starts from gives {self._values(bad, results, 'eval ')} before any "
                f"training: its weights are not all numbers, or overflow in {self.stage.precision}. If an earlier "
                "stage made it, that stage's export is not usable; otherwise check the model, or train in bf16 or fp32")
        self._look(step, f"evaluation at step {step} gave {self._values(bad, results, 'eval ')}, "
                         "and the weights are no "
                         "longer numbers")
        raise Diverged(f"evaluation at step {step} gave {self._values(bad, results, 'eval ')}, though the weights are "
                       f"numbers: the model overflows in {self.stage.precision} on the evaluation rows. The stage "
                       f"stopped before saving or exporting it. Try {self._fixes()}")

    def _look(self, step: int, what: str) -> None:
        """Stop, saying `what`, unless the weights at `step` are numbers; once per step (nothing
        trains between the last step's save and the export)."""
        if self.finite_at == step:
            return
        if not self._weights_finite():
            raise Diverged(f"training diverged: {what}. {self._advice()}")
        self.finite_at = step

    def _weights_finite(self) -> bool:
        """Whether every process's share of every trained model's weights is numbers (a collective)."""
        flags: dict[torch.device, list[torch.Tensor]] = {}  # one read per device (offloaded shares are on the host)
        for engine in self.engines:
            for param in engine.module.parameters():
                for tensor in (getattr(param, "ds_tensor", None), param.data):  # ZeRO-3: the share, and any gathered
                    if tensor is not None and tensor.numel():
                        flags.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
        finite = all(bool(torch.stack(group).all()) for group in flags.values())
        return not collectives.sum_each_process([0.0 if finite else 1.0])[0]

    @staticmethod
    def _values(keys: list[str], values: dict, prefix: str = "") -> str:
        return ", ".join(f"{prefix}{key} {values[key]}" for key in keys)

    def _advice(self) -> str:
        tag = newest_intact(self.checkpoints.stage_folder).tag
        kept = f"its newest checkpoint, {tag}, is from before" if tag else "no checkpoint of it was saved"
        return f"The stage stopped before saving or exporting weights that are not numbers; {kept}. Try {self._fixes()}"

    def _fixes(self) -> str:
        stage = self.stage
        fixes = [f"a lower learning_rate ({stage.learning_rate:g} now)",
                 "max_grad_norm above 0 (gradient clipping is off now)" if not stage.max_grad_norm else None,
                 "warmup_steps" if not stage.warmup_steps else None,
                 "bf16 or fp32 rather than fp16" if stage.precision == "fp16" else None]
        return ", ".join(f for f in fixes if f)


@dataclass
class Loop:
    """What a supervised stage (SFT, RM, DPO) hands to `train`.

    `loss(batch, micro, step)` returns this micro batch's share of the step's mean
    loss over the whole global batch (every process, every micro batch: e.g. its
    summed token losses over all the step's trained tokens), and the same kind of
    share of each metric to log, as detached tensors on the device. Shares add up
    to the step's means whatever the packing, micro batch size or process count.
    """

    batch: Callable[[batching.MicroBatch], object]  # micro batch -> data.Batch on the device
    loss: Callable[[object, batching.MicroBatch, batching.Step], tuple[torch.Tensor, dict]]
    evaluate: Callable[[], dict]  # -> eval metrics, same on every rank
    steps: Callable[[int], list[batching.Step]]  # epoch -> this process's steps
    steps_per_epoch: int
    total_steps: int
    flops: Callable[[object], float] = lambda batch: 0.0  # model FLOPs of a batch, for MFU


def train(engine, loop: Loop, stage, ctx) -> dict:
    """Run (or resume) a supervised stage's optimizer steps on the loop; returns initial and final
    eval metrics."""
    return run(OptimizerSteps(engine, loop, stage.log_interval), stage, ctx)


class OptimizerSteps:
    """A supervised stage's `Work`: a unit is one optimizer step over the micro batches the
    stage's `Loop` plans for it."""

    steps_per_unit = 1

    def __init__(self, engine, loop: Loop, log_interval: int):
        self.engine, self.loop, self.log_interval = engine, loop, log_interval
        self.others: dict = {}
        self.total_steps = loop.total_steps
        self.epoch = -1  # the epoch of the last step
        self.planned: list[batching.Step] = []  # that epoch's steps

    def advance(self, step: int, window: Window) -> None:
        epoch, offset = divmod(step, self.loop.steps_per_epoch)
        if epoch != self.epoch:
            self.epoch, self.planned = epoch, self.loop.steps(epoch)
        planned = self.planned[offset]
        engine, world = self.engine, dist.get_world_size()
        engine.train()  # evaluation leaves the model in eval mode, loading too
        last = len(planned.micro_batches) - 1
        for j, micro in enumerate(planned.micro_batches):
            # Packed steps vary in micro batch count: the last one is the boundary.
            batch = self.loop.batch(micro)
            _, shares = train_on(engine, batch, functools.partial(self.loop.loss, batch, micro, planned), j == last,
                                 world)
            window.add(batch, shares, self.loop.flops(batch) if micro.weight else 0.0)

    def record(self) -> dict:
        record = {"lr": self.engine.get_lr()[0]}
        norm = grad_norm(self.engine)
        if norm is not None:
            record["grad_norm"] = norm
        record["epoch"] = self.epoch
        return record

    def evaluate(self) -> dict:
        return self.loop.evaluate()

    def state(self) -> dict:
        return {}

    def resume(self, state: dict) -> None:
        pass


def train_on(engine, batch, objective: Callable[[], tuple], boundary: bool, world: int) -> tuple:
    """One micro batch of an optimizer step on a DeepSpeed engine, for every stage (supervised and RL):
    `objective()` returns (this micro batch's share of the step's mean loss, anything else), and that
    tuple is returned. The share is a mean over the whole step already, so DeepSpeed must not divide
    by its accumulation steps; it averages gradients over processes, and the shares add up over them,
    so the loss is scaled by the process count. The forward and the backward both run inside the
    batch's `apart()` (gradient checkpointing recomputes the forward in the backward, on shared
    sequences with the exchange). The optimizer steps at the `boundary` (the step's last micro batch)."""
    engine.set_gradient_accumulation_boundary(boundary)
    with batch.apart():
        out = objective()
        engine.backward(out[0] * world, scale_wrt_gas=False)
    engine.step()
    return out


def grad_norm(engine) -> float | None:
    """The gradient norm over every process of the engine's last optimizer step, before clipping (None: unknown)."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


class Window:
    """What happened since the last metrics record: the stage's metric shares (summed on
    the device, read once per record), tokens, model FLOPs, time and peak memory.
    A PPO rollout is one window: its sequences are added once, however often they are trained on."""

    def __init__(self, ctx):
        self.device, self.on_gpu = ctx.device, ctx.on_gpu
        self.peak_flops = _device_peak_flops(ctx)
        self.nodes = max(1, ctx.world_size // ctx.task.processes_per_node)
        self.restart()

    def restart(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.real = self.processed = 0
        self.flops = 0.0
        self.started = time.time()
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)

    def add(self, batch, shares: dict, flops: float) -> None:
        for key, value in shares.items():
            value = value.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.real += batch.real_tokens
        self.processed += batch.processed_tokens
        self.flops += flops

    def close(self, steps: int) -> dict:
        """The record's numbers (means over the window's `steps` optimizer steps and every
        process; memory: the largest process's GPU peak, host memory per node); restarts the window."""
        elapsed = max(time.time() - self.started, 1e-9)
        names = list(self.sums)
        local = torch.stack([self.sums[k] for k in names] + [
            torch.tensor(float(v), device=self.device) for v in (self.real, self.processed, self.flops)])
        *means, real, processed, flops = collectives.sum_once_per_group(local.double()).tolist()
        (rss,) = collectives.sum_each_process([float(tracking.host_rss_bytes())])  # each process's own memory
        record = {k: v / steps for k, v in zip(names, means)}
        world = dist.get_world_size()
        gpu_peak = gpu_reserved = None
        if self.on_gpu:
            peaks = torch.tensor([torch.cuda.max_memory_allocated(self.device),
                                  torch.cuda.max_memory_reserved(self.device)], dtype=torch.float64, device=self.device)
            gpu_peak, gpu_reserved = (v / 2**30 for v in collectives.largest_of_any_process(peaks).tolist())
        record.update(
            tokens_per_s=real / elapsed,
            token_efficiency=real / max(processed, 1.0),
            step_s=elapsed / steps,
            mfu=flops / (elapsed * world * self.peak_flops) if self.peak_flops else None,
            gpu_mem_peak_gib=gpu_peak,
            gpu_mem_reserved_gib=gpu_reserved,
            host_rss_gib=rss / self.nodes / 2**30,
        )
        self.restart()
        return record


def _device_peak_flops(ctx) -> float | None:
    """Datasheet dense peak of this process's GPU in the stage's precision; None on CPU
    or for a GPU outside the catalogue."""
    if not ctx.on_gpu:
        return None
    from core.hardware import gpu_for_device

    gpu = gpu_for_device(torch.cuda.get_device_name(ctx.device))
    return gpu.peak_tflops(ctx.task.stage.precision) * 1e12 if gpu else None
