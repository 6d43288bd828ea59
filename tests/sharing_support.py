"""What the sequence-sharing tests share (tests/test_sequence_parallel.py: sft, rm, dpo and the
tiled passes; tests/test_sequence_parallel_rl.py: ppo): the stages and pipelines they run in
several layouts, and how two runs' figures are compared."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest

from core import metrics
from core import sequence_parallel as rules
from core.config import load_pipeline
from tests.conftest import read_metrics, read_result, run_cli, tiny_pipeline, write_pipeline

needs_the_stack = pytest.mark.skipif(rules.stack_problem() is not None, reason="this stack has no Ulysses attention")

# The layouts each comparison runs: (processes, sequence_parallel). 1 process first: the others
# are compared with it.
LAYOUTS = ((1, 1), (2, 2), (4, 2))
# Figures that depend on how the work is laid out (time, padding per process), not on what is learned.
LAYOUT_FIGURES = {*metrics.GROUPS["perf"], *metrics.GROUPS["memory"], *metrics.GROUPS["time"],
                  *metrics.GROUPS["gpu_busy"], "time", "eta_s", "seconds"}
STAGES = ("sft", "rm", "dpo")
# The reward model's std of rewards is sqrt(mean of squares - square of mean): with rewards near
# -1.3 and a std near 0.02, float32 rewards 1e-7 apart make it differ by ~3e-4.
TOLERANCE = {"eval_reward_std": 1e-3}
# The reward model at learning rate 1e-2 separates the pairs within two steps, and its figures there
# (grad_norm 0.39 -> 0.012, a margin of 0.008) carry float32 rounding up to 1.8e-4 of their size
# between layouts since the built-in model's heads are 32 wide (2 heads: one per sharing process;
# with 4 heads of 16 they agreed to 1e-4). Misaligned shards are off by ~1e-2.
KIND_TOLERANCE = {"rm": 3e-4}
# The global batch of every sharing stage: rows (pairs, for rm and dpo) per optimizer step.
PAIRS_PER_STEP = 16


def stages(kinds=STAGES) -> list[dict]:
    rows = {"path": "builtin:digits", "eval_split": "eval", "max_rows": 64}
    rates = {"sft": 3e-3, "rm": 1e-2, "dpo": 3e-3, "sft_misaligned": 3e-3}
    return [{"name": kind, "kind": kind, "model": "builtin:tiny-llama", "data": rows, "max_steps": 3,
             "learning_rate": rates[kind]} for kind in kinds]


def sharing_pipeline(processes: int, sequence_parallel: int, kinds=STAGES, name="sp", **extra) -> dict:
    return tiny_pipeline(name, stages=stages(kinds), cluster={"tasks_per_node": processes}, **extra, defaults={
        "log_interval": 1, "micro_batch_size": 8, "global_batch_size": PAIRS_PER_STEP, "warmup_steps": 0,
        "sequence_parallel": sequence_parallel})


def ran(workdir: Path, spec: dict) -> Path:
    """`run` of the pipeline `spec` in `workdir`, which must succeed: its run folder."""
    done = run_cli("run", write_pipeline(workdir, spec), cwd=workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return workdir / "runs" / spec["name"]


def figures(folder: Path) -> dict:
    """{(step, name): value} of everything a stage logged that the layout must not change."""
    return {(record["step"], name): value for record in read_metrics(folder) for name, value in record.items()
            if name not in LAYOUT_FIGURES | {"step"} and isinstance(value, (int, float))}


def one_pair(result: dict, name: str) -> float:
    """How much one pair ranked the other way moves the accuracy figure `name`: a pair whose two
    rewards are within float32 rounding of each other may rank either way between layouts (seen:
    eval_accuracy 0.07 vs 0.075 of 200 pairs), while every other figure of the step agrees."""
    if not name.endswith("accuracy"):
        return 1e-6
    pairs = result.get("eval_pairs") if name.startswith("eval_") else PAIRS_PER_STEP
    return 1 / pairs + 1e-9


def disagreements(one: Path, other: Path) -> list[str]:
    a, b = figures(one), figures(other)
    assert a.keys() == b.keys()
    result = read_result(one)
    usual = KIND_TOLERANCE.get(result["kind"], 1e-4)
    return [f"step {step} {name}: {a[step, name]} vs {b[step, name]}" for step, name in sorted(a)
            if not math.isclose(a[step, name], b[step, name], rel_tol=TOLERANCE.get(name, usual),
                                abs_tol=one_pair(result, name))]


def agreeing_with_one_process(one: Path, shared: Path, layout: tuple[int, int]) -> list[dict]:
    """The metrics of the stage folder `shared`, run in `layout`, once every figure agrees with
    those of `one` (the same stage on 1 process) and the stage is seen to have run in that layout."""
    assert disagreements(one, shared) == []
    assert read_result(shared)["world_size"] == layout[0]
    log = next((shared / "logs").glob("*_0_log.out")).read_text()
    assert f"{layout[0] // layout[1]} data-parallel" in log, log[-2000:]
    # Host memory per node counts every process of it, sharing or not (~processes x one process's).
    rss = [next(r["host_rss_gib"] for r in read_metrics(folder) if "host_rss_gib" in r) for folder in (one, shared)]
    assert rss[1] > rss[0] * (layout[0] / 2 + 0.25), rss
    return read_metrics(shared)


def load_pipeline_of(spec: dict):
    with tempfile.TemporaryDirectory() as folder:
        return load_pipeline(str(write_pipeline(Path(folder), spec)))
