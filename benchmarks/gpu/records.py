"""The GPU runs on record, each planned again: every record is a test of the planner.

A record is a case result the GPU benchmark wrote (benchmarks/gpu/runner.py) and a session
kept under benchmarks/results/: the project's own SFT or DPO stage (`kind: project`, the
1B-shaped throughput and memory cases) or a slice of the 34B (`kind: slice`). `planned`
rebuilds what the case ran from the record and its folder alone, with no GPU and no model
files: the stage's settings (through the pipeline schema, as `plan` reads them), the model's
shape (the workload's named shape, or the slice's layers of the 34B), the GPU from the
catalogue, one process, and the rows' token lengths (the workload's rows are made again from
their fixed seeds). The planner then estimates that case as it would any stage, and its step
time and GPU peak stand beside the measured ones.

A folder holding SUPERSEDED.md is left out: it says which change made its figures no longer
the code's (e.g. a slowness fixed since). A folder's superseded.json can leave out one figure
of one case the same way, {"<case>": {"memory": "why"}}. Only records that measured training
steps count.

Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu import project, workload
from benchmarks.gpu import slice as slice_34b
from benchmarks.gpu.cases import Case

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
SUPERSEDED = "SUPERSEDED.md"
SUPERSEDED_FIGURES = "superseded.json"
GiB = 1024**3

# What a recorded case is held to: the plan's step time within +-20% of the measured one, and its
# GPU peak from 5% under to 10% over the measured reserved peak (under is the unsafe side: an OOM).
TIME_TOLERANCE = 0.20
MEMORY_UNDER, MEMORY_OVER = 0.05, 0.10


@dataclass(frozen=True)
class Record:
    path: Path
    case: str
    kind: str  # project | slice
    gpu: str  # catalogue name of the GPU it ran on
    step_s: float
    reserved_gib: float | None
    allocated_gib: float | None
    data: dict  # the case result as written
    cores: int  # the machine's CPU cores (its env.json), all of them the one process's
    superseded: dict  # figure ("time" | "memory") -> why the code no longer does what it measured

    @property
    def name(self) -> str:
        return f"{self.path.parent.relative_to(RESULTS)}/{self.case}"


def records(root: Path = RESULTS) -> list[Record]:
    """Every record under root that measured training steps on a GPU, outside superseded folders."""
    found = []
    for path in sorted(root.rglob("*.json")):
        if any((parent / SUPERSEDED).is_file() for parent in path.parents if root in parent.parents or parent == root):
            continue
        if path.name == SUPERSEDED_FIGURES:
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(data, dict) or data.get("kind") not in ("project", "slice"):
            continue
        if data.get("status") != "ok" or not data.get("steps_measured") or not data.get("catalogue_gpu"):
            continue
        found.append(Record(path, data["case"], data["kind"], data["catalogue_gpu"], data["step_s"],
                            data.get("gpu_mem_reserved_gib"), data.get("gpu_mem_peak_gib"), data,
                            _cores(path.parent), _superseded(path.parent).get(data["case"], {})))
    return found


def calibrations(root: Path = RESULTS) -> dict:
    """The calibration files on record (`python -m pipeline calibrate` on a lent GPU, kept as
    calibration-*.json beside that session's records), by catalogue GPU; the latest where a GPU
    has several. The fit takes its records' matmul time at the rates these measured at the
    records' own shapes."""
    from core import calibration as calibration_file

    found = {}
    for path in sorted(root.rglob("calibration-*.json")):
        if any((parent / SUPERSEDED).is_file() for parent in path.parents if root in parent.parents or parent == root):
            continue
        measured = calibration_file.load(path)
        if measured.gpu and measured.gpu.catalogue and measured.matmul:
            if measured.gpu.catalogue not in found or measured.date > found[measured.gpu.catalogue].date:
                found[measured.gpu.catalogue] = measured
    return found


def _superseded(folder: Path) -> dict:
    path = folder / SUPERSEDED_FIGURES
    return json.loads(path.read_text()) if path.is_file() else {}


def _cores(folder: Path) -> int:
    env = folder / "env.json"
    facts = json.loads(env.read_text()).get("facts", {}) if env.is_file() else {}
    return facts.get("cpu_count") or DEFAULT_CORES


DEFAULT_CORES = 16  # the lent GPU machine's (../shared/GPU.md), where a record has no env.json


def planned(record: Record, calibration=None):
    """The planner's Estimate of the recorded case (pipeline/plan/estimate.py); with a
    calibration (core/calibration.py), the rates it measured in place of the built-in ones."""
    from pipeline.plan.estimate import estimate_stage

    knobs, shape, lengths = _case(record)
    hardware = _hardware(record)
    if calibration is not None:
        hardware = dataclasses.replace(hardware, calibration=calibration)
    return estimate_stage(knobs, shape, hardware, lengths=lengths)


def _case(record: Record):
    """(Knobs, ModelShape, RowLengths or None) of what the recorded case ran."""
    return (_slice_case if record.kind == "slice" else _project_case)(record)


def _hardware(record: Record):
    """One process on the recorded GPU, with all of the machine's cores."""
    from core import hardware
    from pipeline.plan.inputs import Hardware

    gpu = hardware.gpu(record.gpu)
    return Hardware(gpu, 1, 1, gpu.memory_bytes, int(gpu.host_memory_gib * GiB), "the benchmark machine",
                    cores_per_process=record.cores)


def _slice_case(record: Record):
    facts = record.data["slice"]
    knobs = slice_34b.per_gpu_knobs(slice_34b.shipped()[facts["kind"]])
    knobs = dataclasses.replace(knobs, max_len=facts["max_len"])
    # Rows of exactly max_len tokens: the planner's own assumption without sampled lengths.
    return knobs, slice_34b.slice_shape(facts["layers"], facts["max_len"]), None


def _project_case(record: Record):
    from core.config import PipelineSpec
    from core.shapes import from_config_json
    from pipeline.lengths import RowLengths
    from pipeline.plan.inputs import Knobs

    info = json.loads((record.path.parent / "workload.json").read_text())
    run_settings = record.data["run_settings"]
    described = info["described"]
    config = workload.shape_config(described["shape"], described["max_len"])
    shape = from_config_json({**config, "model_type": "llama"}, described["shape"])
    case = Case(record.case, "project", record.data["params"])
    spec = project.pipeline_spec(case, run_settings, info, record.gpu, Path("runs"))
    stage = PipelineSpec.model_validate(spec).stages[0]
    knobs = Knobs.from_stage(stage)
    name = project.stage_settings(case, run_settings)["data"]
    per_row = _row_lengths(described["rows"], config["vocab_size"], info["median_setting"], described["max_len"])[name]
    return knobs, shape, RowLengths(per_row, f"{len(per_row)} rows of {name}, made again", "words")


@functools.cache
def _row_lengths(rows: int, vocab: int, median: int, max_len: int) -> dict[str, tuple]:
    """The sequence lengths of every row of a workload's data files, by file name. Making the rows
    again draws tens of millions of random words, and the records share a few workloads: once each."""
    return {name: tuple(tuple(workload.sequence_lengths([row])) for row in made)
            for name, made in workload.data_files(rows, vocab, median, max_len).items()}


def compare(record: Record, calibration=None) -> dict:
    """The measured and planned step time and GPU peak of a record, and how far apart (planned
    with a calibration's rates when one is given)."""
    estimate = planned(record, calibration)
    plan_step = estimate.time.step_s
    # torch's reserved peak leaves out the CUDA context, which the plan counts (it must fit too)
    context = sum(i.bytes for i in estimate.memory.items if i.category == "context")
    plan_peak = (estimate.memory.gpu_peak - context) / GiB
    out = {"record": record.name, "step_s": record.step_s, "plan_step_s": plan_step,
           "time_error": plan_step / record.step_s - 1, "reserved_gib": record.reserved_gib,
           "plan_peak_gib": plan_peak, "estimate": estimate}
    out["memory_error"] = plan_peak / record.reserved_gib - 1 if record.reserved_gib else None
    return out


# --------------------------------------------------------------------------- the fit

# The rates pipeline/plan/rates.py takes from the records, as the fit's columns: a column is
# (name, the rate's unit, the feature it multiplies). Matmuls and the host copies are not
# fitted: they are subtracted from the measured step first, the matmuls at the rates a
# calibration on record measured at the record's shapes (calibrations(); else the GPU's 8192^3
# rate), the copies at the built-in host link. The memory-bound columns are bytes over the
# built-in copy bandwidth (core/hardware.py copy_bandwidth_gbs), what a calibration measures.
FITTED = (
    ("SDPA_MASKED_EFFICIENCY", "1/x", lambda w, r, k: w["attention_flops"] / r.peak_flops if k == "sdpa" else 0.0),
    ("LOSS_BYTES_PER_LOGIT", "B", lambda w, r, k: w["logits"] / r.hbm_bytes_per_s.value),
    ("ZERO3_LAYER_PASS_S", "s", lambda w, r, k: w["layer_passes"] * (w["zero_stage"] == 3)),
    ("LORA_BYTES_PER_ELEMENT", "B", lambda w, r, k: w["lora_elements"] / r.hbm_bytes_per_s.value),
    ("STEP_BYTES_PER_PARAM[0]", "B",
     lambda w, r, k: w["gpu_stepped_params"] * (w["zero_stage"] == 0) / r.hbm_bytes_per_s.value),
    ("STEP_BYTES_PER_PARAM[1,2]", "B",
     lambda w, r, k: w["gpu_stepped_params"] * (w["zero_stage"] != 0) / r.hbm_bytes_per_s.value),
    ("HOST_ADAM_PARAMS_PER_S_PER_CORE", "1/x", lambda w, r, k: w["host_adam_params"] / w["cores"]),
)


def fit(found: list[Record]) -> dict:
    """Least squares (relative errors) of the FITTED rates over the records: name -> value."""
    import numpy as np

    from pipeline.plan.estimate import stage_models
    from pipeline.plan.inputs import attention_kernel
    from pipeline.plan.timing import rates_for

    measured = calibrations()
    rows, targets = [], []
    for record in found:
        estimate = planned(record)
        t, knobs = estimate.time, estimate.knobs
        rates = rates_for(knobs, _hardware(record), *stage_models(knobs, _case(record)[1]))
        work = {**t.work, "zero_stage": knobs.zero_stage, "cores": record.cores}
        kernel = attention_kernel(knobs.attention, True, _case(record)[1])
        matmul = (planned(record, measured[record.gpu]).time.compute_terms["matmul"] if record.gpu in measured
                  else t.compute_terms["matmul"])
        known = matmul + t.work["host_copies_s"] + t.exposed_communication_s
        rows.append([column(work, rates, kernel) / record.step_s for _, _, column in FITTED])
        targets.append((record.step_s - known) / record.step_s)
    solution, *_ = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)
    return {name: (1 / value if unit == "1/x" else value) for (name, unit, _), value in zip(FITTED, solution)}


def main() -> None:
    """A table of every record against the plan (python -m benchmarks.gpu.records), or with
    `fit` the rates the records give (python -m benchmarks.gpu.records fit), or with
    `--calibration FILE` the records of that file's GPU planned with the rates it measured."""
    import sys

    if sys.argv[1:] == ["fit"]:
        for name, value in fit(records()).items():
            print(f"{name:<34} {value:.4g}")
        return
    calibration, found = None, records()
    if sys.argv[1:2] == ["--calibration"] and len(sys.argv) == 3:
        from core import calibration as calibration_file

        calibration = calibration_file.load(Path(sys.argv[2]))
        gpu = calibration.gpu.catalogue if calibration.gpu else None
        found = [r for r in found if r.gpu == gpu]
        print(f"planned with {sys.argv[2]} ({calibration.node}, {calibration.date}), the records of {gpu}\n")
    elif sys.argv[1:]:
        raise SystemExit("usage: python -m benchmarks.gpu.records [fit | --calibration FILE]")
    print("| record | step s | plan step s | time | reserved GiB | plan GiB | memory |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for record in found:
        c = compare(record, calibration)
        memory = f"{c['memory_error']:+.1%}" if c["memory_error"] is not None else "—"
        if "memory" in record.superseded:
            memory += " (superseded)"
        print(f"| {c['record']} | {c['step_s']:.3f} | {c['plan_step_s']:.3f} | {c['time_error']:+.1%} | "
              f"{c['reserved_gib'] or 0:.1f} | {c['plan_peak_gib']:.1f} | {memory} |")


if __name__ == "__main__":
    main()
