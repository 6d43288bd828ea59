"""What a metrics.jsonl record holds, and how people and programs read it.

Torch-free: the stages write records (stages/tracking.py), and the login node
reads them back for `status` (a running stage's step/total and ETA), the HTML
report and the README's measured columns. One owner for the record's names, the
TensorBoard group of each key, and the progress line.

A record is a training record (one per log interval, or one per rollout for
PPO) or an eval record (every key but `step` and `time` starts with `eval_`).
Every training record of every stage kind carries MEASURED_KEYS; the GPU ones
are null on a CPU.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Keys every training record carries, in every stage kind.
MEASURED_KEYS = (
    "tokens_per_s",  # real tokens (padding not counted) per second, all processes
    "token_efficiency",  # real / processed tokens
    "step_s",  # seconds per optimizer step (evaluation and saving excluded)
    "mfu",  # model FLOPs (core/flops.py) over the GPUs' datasheet peak; null on CPU
    "gpu_mem_peak_gib",  # torch's max allocated since the previous record, the largest of all processes
    "gpu_mem_reserved_gib",  # torch's max reserved since the previous record, the largest of all processes
    "host_rss_gib",  # resident memory of the stage's processes, per node
    "eta_s",  # seconds until the last step, at this run's pace so far (evaluation and saving included)
)
GPU_ONLY_KEYS = ("mfu", "gpu_mem_peak_gib", "gpu_mem_reserved_gib")
# Bookkeeping, not plotted: the wall-clock time of the record and the stage's step count.
CLOCK_KEYS = ("step", "time", "total_steps")
# What the progress line shows after the step, if the record has it.
HEADLINE_KEYS = ("loss", "policy_loss", "reward")
# Then, as they fit in LINE_CHARS, the few numbers a person watching a stage needs (is it
# learning, is it stable, does it fit); the record's others are in metrics.jsonl.
WATCHED_KEYS = ("accuracy", "margin", "reward_accuracy", "reward_margin", "kl", "entropy", "response_length",
                "clip_fraction", "grad_norm", "mfu", "gpu_mem_peak_gib", "lr")
LINE_CHARS = 160

# Where an RL rollout's wall time (rollout_s) goes: these phases add up to it, nothing left out
# (other_s: what is none of the others, e.g. counting the rollout's FLOPs and the KL controller;
# sync_s: handing the actor's weights to the vLLM engine after its update, 0 with other engines).
ROLLOUT_PHASES = ("generate_s", "score_s", "train_s", "sync_s", "other_s")
# Parts of a phase, each counted inside the phase named beside it: ZeRO-3's gathering of the
# actor's weights around generation (and their release), and moving offloaded frozen models
# (reference, reward model) to the device and back. 0 where nothing is gathered or moved.
ROLLOUT_PHASE_PARTS = {"gather_s": "generate_s", "offload_s": "score_s"}
# The GPU's busy share (0-1) in each phase, as nvidia-smi shows it (NVML's utilisation, sampled
# by the stage while the phase ran: stages/phases.py), and over the whole rollout; null without a
# GPU or NVML, or where no reading fell in the phase: never guessed.
GPU_BUSY_KEYS = ("gpu_busy_generate", "gpu_busy_score", "gpu_busy_train", "gpu_busy_rollout")

# The gradient norms a training record holds (the critic's: gae). With the losses, the numbers
# that say training still computes numbers (stages/engine.py looks at the weights when one of
# them is nan or inf).
GRADIENT_NORMS = ("grad_norm", "critic_grad_norm")

GROUPS = {
    "perf": ("tokens_per_s", "token_efficiency", "step_s", "mfu", "rollout_s", "generate_tokens_per_s",
             "generate_bandwidth_fraction", "score_tokens_per_s", "train_tokens_per_s", "train_token_efficiency"),
    "memory": ("gpu_mem_peak_gib", "gpu_mem_reserved_gib", "host_rss_gib"),
    "time": (*ROLLOUT_PHASES, *ROLLOUT_PHASE_PARTS),  # where a PPO rollout's time goes
    "gpu_busy": GPU_BUSY_KEYS,
    "progress": ("eta_s", "epoch", "rollout"),
    "optim": ("lr", *GRADIENT_NORMS, "kl_coef"),
    # vLLM sampling: bytes each process handed the engine at the sync, and its log-probs against the trainer's
    "sampler": ("sync_bytes", "sampler_logprob_diff_mean", "sampler_logprob_diff_max"),
}
_GROUP_OF = {key: group for group, keys in GROUPS.items() for key in keys}

def not_finite(values: dict) -> list[str]:
    """The losses and gradient norms among `values` that are nan or inf."""
    return [key for key, value in values.items()
            if (key == "loss" or key.endswith("_loss") or key in GRADIENT_NORMS)
            and isinstance(value, float) and not math.isfinite(value)]


def tag(key: str) -> str | None:
    """The TensorBoard tag of a record key (train/loss, eval/loss, perf/mfu, ...); None
    for bookkeeping keys."""
    if key in CLOCK_KEYS:
        return None
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    return f"{_GROUP_OF.get(key, 'train')}/{key}"


def is_eval(record: dict) -> bool:
    keys = [k for k in record if k not in CLOCK_KEYS]
    return bool(keys) and all(k.startswith("eval_") for k in keys)


def scalars(record: dict) -> dict[str, float]:
    """(tag, value) of every number of a record worth plotting: nulls and bookkeeping left out."""
    out = {}
    for key, value in record.items():
        name = tag(key)
        if name is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                out[name] = float(value)
    return out


def read(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line being written right now (no newline yet) is skipped."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def training(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if not is_eval(r)]


def evaluations(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if is_eval(r)]


# --------------------------------------------------------------------------- progress


def eta_seconds(steps_done: int, elapsed_s: float, steps_left: int) -> float | None:
    """Seconds left at the pace so far: `steps_done` steps took `elapsed_s`. None before the first step."""
    if steps_left <= 0:
        return 0.0
    if steps_done <= 0:
        return None
    return elapsed_s / steps_done * steps_left


def duration_text(seconds: float | None) -> str:
    """0:42, 12:05, 3:07:15, 2d 03:07:15 — the way a log line shows a time span."""
    if seconds is None:
        return "?"
    total = int(round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours}:{minutes:02d}:{secs:02d}" if hours or days else f"{minutes}:{secs:02d}"
    return f"{days}d {text}" if days else text


def number_text(value) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value)


def progress_line(stage: str, record: dict) -> str:
    """One line per training record, readable in a log file, at most about LINE_CHARS long:
    `[sft] step 40/200  20%  ETA 1:20  loss 0.5312  tokens/s 12,345 | grad_norm=1.2 lr=0.003`."""
    step, total = record["step"], record.get("total_steps")
    head = f"[{stage}] step {step}/{total} {100 * step / total:3.0f}%" if total else f"[{stage}] step {step}"
    parts = [head, f"ETA {duration_text(record.get('eta_s'))}"]
    parts += [f"{k} {number_text(record[k])}" for k in HEADLINE_KEYS if record.get(k) is not None]
    if record.get("tokens_per_s") is not None:
        parts.append(f"tokens/s {record['tokens_per_s']:,.0f}")
    line = "  ".join(parts)
    watched = [f"{k}={number_text(record[k])}" for k in WATCHED_KEYS if record.get(k) is not None]
    for count in range(len(watched), 0, -1):
        longer = f"{line} | {' '.join(watched[:count])}"
        if len(longer) <= LINE_CHARS:
            return longer
    return line


def eval_line(stage: str, record: dict) -> str:
    shown = " ".join(f"{k}={number_text(v)}" for k, v in record.items() if k not in CLOCK_KEYS)
    return f"[{stage}] eval at step {record['step']}: {shown}"


@dataclass
class Progress:
    step: int
    total_steps: int | None
    eta_s: float | None
    time: float | None  # when the record was written (unix seconds)

    def text(self, now: float | None = None) -> str:
        """`step 40/200 (20%), ETA 1:20 as of 0:05 ago`."""
        if self.total_steps:
            out = f"step {self.step}/{self.total_steps} ({100 * self.step / self.total_steps:.0f}%)"
        else:
            out = f"step {self.step}"
        if self.eta_s is not None:
            out += f", ETA {duration_text(self.eta_s)}"
        if self.time is not None:
            age = max(0.0, (now if now is not None else time.time()) - self.time)
            out += f" as of {duration_text(age)} ago"
        return out


def progress(metrics_path: Path) -> Progress | None:
    """Where a stage is, from the last training record of its metrics.jsonl; None before its first."""
    return progress_of(read(metrics_path))


def progress_of(records: list[dict]) -> Progress | None:
    """`progress` of records already read."""
    records = training(records)
    if not records:
        return None
    last = records[-1]
    return Progress(int(last["step"]), last.get("total_steps"), last.get("eta_s"), last.get("time"))


# --------------------------------------------------------------------------- trackers


def check_trackers(spec, here: bool) -> None:
    """The trackers a pipeline asks for can be imported by the python its stages run with,
    when that is this one (`here`; a container has to bring its own): InvalidInput (exit 2)."""
    import importlib.util

    from core.errors import InvalidInput

    wandb = spec.tracking.wandb
    if wandb is None or not here:
        return
    if importlib.util.find_spec("wandb") is None:
        raise InvalidInput(
            f"tracking.wandb: project '{wandb.project}' asks for Weights & Biases, but the wandb package is not "
            "installed in this python: `pip install wandb`, or remove tracking.wandb (TensorBoard files are "
            "written either way)"
        )
