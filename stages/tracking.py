"""Where a stage's records go, on rank 0: metrics.jsonl, TensorBoard, W&B (when the pipeline
asks for it), and the log: one progress line per training record, or a live bar when stdout
is a terminal.

What a record holds and how its keys are grouped is core/metrics.py's; where the files
live is core/runfolder.py's. Secrets (WANDB_API_KEY, HF_TOKEN) are read by the libraries
from the environment and never written here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from core import metrics as records
from core.failure import writing

if TYPE_CHECKING:  # imported where used: torch and tqdm load only in the stage process
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

log = logging.getLogger("stages")


class Metrics:
    """The records of one stage. Every rank keeps the clock (the ETA is the same
    everywhere); only rank 0 writes."""

    def __init__(self, ctx, total_steps: int):
        self.folder, self.is_main, self.task = ctx.folder, ctx.is_main, ctx.task
        self.path = self.folder.metrics
        self.total_steps = total_steps
        self.start_step, self.started = 0, time.time()
        self._tensorboard: SummaryWriter | None = None
        self._bar: tqdm | None = None
        self._wandb: Any = None  # a wandb run (wandb is optional, untyped)
        self._live = sys.stdout.isatty()

    def truncate_after(self, step: int) -> None:
        """A (re)start after `step` (-1: from scratch): forget the lines past it (a resumed run
        rewrites them, and TensorBoard hides its events past it), and time the ETA from here."""
        self.start_step, self.started = max(step, 0), time.time()
        if not self.is_main:
            return
        if self.path.exists():
            kept = [r for r in records.read(self.path) if r["step"] <= step]
            with writing(self.path, "metrics.jsonl"):
                self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._open(purge_from=step + 1)

    def write(self, record: dict) -> None:
        record = dict(record)
        now = time.time()
        if not records.is_eval(record):
            step = record["step"]
            record["eta_s"] = records.eta_seconds(step - self.start_step, now - self.started, self.total_steps - step)
            record["total_steps"] = self.total_steps
        record["time"] = round(now, 3)
        if not self.is_main:
            return
        if self._tensorboard is None:
            self._open(purge_from=None)
        assert self._tensorboard is not None  # _open made it
        with writing(self.path, "metrics.jsonl"), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = records.scalars(record)
        for name, value in scalars.items():
            self._tensorboard.add_scalar(name, value, global_step=record["step"], walltime=now)
        self._tensorboard.flush()  # a killed or preempted job keeps what it logged
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])
        self._show(record)

    def close(self) -> None:
        """Flush and close the trackers (the job leaves with os._exit: nothing closes them later)."""
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    # ---- outputs

    def _open(self, purge_from: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self._tensorboard is not None:
            self._tensorboard.close()
        self._tensorboard = SummaryWriter(log_dir=str(self.folder.tensorboard), purge_step=purge_from,
                                          flush_secs=30)
        if self.task.wandb is not None and self._wandb is None:
            self._wandb = _start_wandb(self.task, self.folder)

    def _show(self, record: dict) -> None:
        name = self.task.name
        if records.is_eval(record):
            line = records.eval_line(name, record)
        else:
            line = records.progress_line(name, record)
            if self._live:
                self._advance_bar(record)
                return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def _advance_bar(self, record: dict) -> None:
        """A live bar in a terminal (never in a log file: carriage returns would pile up there)."""
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=self.total_steps, initial=self.start_step, desc=self.task.name,
                             unit="step", dynamic_ncols=True)
        bar = self._bar
        bar.update(record["step"] - bar.n)
        shown = {k: records.number_text(record[k]) for k in records.HEADLINE_KEYS if record.get(k) is not None}
        if record.get("tokens_per_s") is not None:
            shown["tokens/s"] = f"{record['tokens_per_s']:,.0f}"
        bar.set_postfix(shown, refresh=True)


def _start_wandb(task, folder):
    """A W&B run for this stage (offline by default); resumed, not duplicated, when the job is requeued."""
    import wandb

    settings = task.wandb
    return wandb.init(
        project=settings.project,
        entity=settings.entity,
        mode=settings.mode,
        dir=str(folder.wandb.parent),  # wandb makes its own wandb/ folder in there (StageFolder.wandb)
        name=f"{task.pipeline}.{task.name}",
        group=task.pipeline,
        job_type=task.stage.kind,
        id=f"{task.pipeline}-{task.name}-{task.spec_hash}",
        resume="allow",
        config=task.stage.model_dump(mode="json", by_alias=True),
        settings=wandb.Settings(console="off", disable_git=True),
    )


def host_rss_bytes() -> int:
    """Resident memory of this process."""
    import psutil  # DeepSpeed depends on it

    return psutil.Process(os.getpid()).memory_info().rss
