"""The project's own SFT and DPO stages as benchmark cases, run the way a user runs them.

The case writes a pipeline file (one stage, local executor), asks
`python -m pipeline plan FILE --json` for the planner's GPU peak and step time,
then runs `python -m pipeline run FILE --force` (--force: a stage the planner
thinks too big is measured anyway). Measurements come from the stage's
metrics.jsonl training records (log_interval 1, one record per optimizer step):
  tokens_per_s          real (non-padding) tokens per second
  token_efficiency      real / processed tokens -> padding share
  step_s, mfu           seconds per step, the stage's own MFU vs the datasheet peak
  gpu_mem_peak_gib      torch.cuda.max_memory_allocated since the previous record
  gpu_mem_reserved_gib  max reserved
Any key a record lacks is reported as null. Throughput skips the first
`warmup_steps` records; memory is the maximum over all training records.

The stage's exported model/ (2.5 GB for 1B) is deleted once the stage is done:
nothing here needs it and the memory matrix would fill the disk.

If a stage reports `device cpu` while a GPU was asked for, the case stops at once (it
would only burn the time budget) and says so.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu.cases import (
    catalogue_gpu,
    datasheet_tflops,
    gradient_checkpointing,
    nvidia_smi,
    read_json,
    read_jsonl,
)
from benchmarks.gpu.workload import model_flops_per_token
from core.runfolder import StageFolder

PIPELINE_NAME = "bench"
REPO = Path(__file__).resolve().parents[2]


def stage_settings(case, settings: dict) -> dict:
    """The training knobs a case runs with (what the table shows)."""
    p = case.params
    checkpointing = p.get("gradient_checkpointing", settings["gradient_checkpointing"])
    checkpointing = gradient_checkpointing(p["kind"], checkpointing)
    micro_batch = p.get("micro_batch_size", settings["micro_batch_size"])
    # A case may fix its batch, steps and length itself (the 34B slice takes the shipped file's).
    default_batch = 2 * micro_batch if p.get("memory") else settings["global_batch_size"]
    return {
        "kind": p["kind"],
        "zero_stage": p.get("zero_stage", settings["zero_stage"]),
        "gradient_checkpointing": checkpointing,
        "micro_batch_size": micro_batch,
        # Memory does not grow with accumulation (gradients accumulate in place): the matrix
        # accumulates 2 micro batches, enough to include that, and stays short.
        "global_batch_size": p.get("global_batch_size", default_batch),
        "max_steps": p.get("max_steps", settings["memory_steps"] if p.get("memory") else settings["steps"]),
        "max_len": p.get("max_len", settings["max_len"]),
        "reference": p.get("reference") if p["kind"] == "dpo" else None,
        "lora_rank": (p.get("lora") or {}).get("rank"),
        "data": p["data"],
        "extra": p.get("extra") or {},
    }


def pipeline_spec(case, settings: dict, info: dict, gpu, runs_dir: Path) -> dict:
    knobs = stage_settings(case, settings)
    data = info["data"]
    kind = knobs["kind"]
    cluster = {"executor": "local", "time": "0:30:00"}
    if settings["device"] == "cuda":
        cluster.update(gpus_per_node=1)
        if gpu:
            cluster["gpu"] = gpu
    else:
        cluster["tasks_per_node"] = 1
    stage = {
        "name": kind,
        "kind": kind,
        "model": info["model"],
        "data": {"path": data[knobs["data"]]["path"], "eval_split": data[f"{kind}-eval"]["path"]},
    }
    if kind == "dpo":
        stage.update(beta=0.1, reference=knobs["reference"])
    if knobs["lora_rank"]:
        stage["lora"] = {"rank": knobs["lora_rank"]}
    stage.update(knobs["extra"])
    return {
        "name": PIPELINE_NAME,
        "runs_dir": str(runs_dir),
        "cluster": cluster,
        "defaults": {
            "precision": settings["precision"],
            "attention": "sdpa",  # flash-attn is not installed on the benchmark machine
            "max_len": knobs["max_len"],
            "micro_batch_size": knobs["micro_batch_size"],
            "global_batch_size": knobs["global_batch_size"],
            "zero_stage": knobs["zero_stage"],
            "gradient_checkpointing": knobs["gradient_checkpointing"],
            "learning_rate": settings["learning_rate"],
            "warmup_steps": 0,
            "max_steps": knobs["max_steps"],
            "log_interval": 1,
            "save_interval": 0,
        },
        "stages": [stage],
    }


# --------------------------------------------------------------------------- the case body


def run(case, work: Path, settings: dict, info: dict) -> None:
    import yaml

    gpu, device_name = None, None
    if settings["device"] == "cuda":
        # Asked of nvidia-smi, not torch: a CUDA context in this waiting process would hold
        # ~0.5 GiB of the GPU the stage is measured on.
        device_name = nvidia_smi("name")
        gpu = settings.get("gpu") or catalogue_gpu(device_name)
    runs_dir = work / "runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    spec = pipeline_spec(case, settings, info, gpu, runs_dir)
    config = work / "pipeline.yaml"
    config.write_text(f"# written by benchmarks/gpu/project.py for case {case.name}\n"
                      + yaml.safe_dump(spec, sort_keys=False))
    facts = {"catalogue_gpu": gpu, "device_name": device_name, "settings": stage_settings(case, settings)}
    _write_facts(work, facts)

    plan_config = config
    if settings["device"] != "cuda":
        # A CPU plan has no GPU memory or time: the dry run asks what the planner would say for
        # this stage on a GPU, so that path is exercised too (the numbers mean nothing here).
        plan_config = work / "plan-on-gpu.yaml"
        facts["plan_gpu"] = settings.get("gpu") or "h100-80gb"
        hypothetical = {**spec, "cluster": {"executor": "local", "gpus_per_node": 1, "gpu": facts["plan_gpu"]}}
        plan_config.write_text(yaml.safe_dump(hypothetical, sort_keys=False))
    planned = subprocess.run([sys.executable, "-m", "pipeline", "plan", str(plan_config), "--json"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
    facts["plan_rc"] = planned.returncode
    print(f"plan: exit {planned.returncode}", flush=True)
    if planned.returncode in (0, 3):  # 3: does not fit; measured anyway
        (work / "plan.json").write_text(planned.stdout)
    else:
        message = (planned.stderr or planned.stdout).strip()
        facts["error"] = "pipeline plan: " + " ".join(line.strip() for line in message.splitlines()[:2])[:600]
        print(message, flush=True)
    _write_facts(work, facts)
    if planned.returncode == 2:  # an invalid pipeline file: `run` would refuse it the same way
        raise SystemExit(1)

    stage = StageFolder.of(runs_dir / PIPELINE_NAME, spec["stages"][0]["name"])
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(config), "--force"], cwd=REPO)
    facts["device_line"], facts["pipeline_rc"] = _watch(process, stage, settings["device"])
    if facts["pipeline_rc"] == "ran-on-cpu":
        facts["error"] = ("the stage ran on the CPU although a GPU was asked for (its log says 'device cpu'); "
                          "stopped at once")
    _write_facts(work, facts)
    for heavy in (stage.model, stage.model.with_name(stage.model.name + ".tmp"), stage.checkpoints):
        shutil.rmtree(heavy, ignore_errors=True)
    if facts["pipeline_rc"] != 0:
        raise SystemExit(1)


def _watch(process: subprocess.Popen, stage: StageFolder, device: str):
    """Wait for `pipeline run`; stop it early if the stage says it runs on the CPU when a GPU was wanted."""
    device_line = None
    while process.poll() is None:
        time.sleep(1.0)
        if device_line is None:
            device_line = _device_line(stage)
            if device_line and device == "cuda" and "device cpu" in device_line:
                process.send_signal(signal.SIGINT)  # `pipeline run` cancels its job on Ctrl-C
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                return device_line, "ran-on-cpu"
    return device_line or _device_line(stage), process.returncode


def _device_line(stage: StageFolder):
    for log in sorted(stage.logs.glob("*_0_log.out")):
        for line in log.read_text(errors="replace").splitlines():
            if ", device " in line and line.startswith("stage "):
                return line.strip()
    return None


def _write_facts(work: Path, facts: dict) -> None:
    (work / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")


# --------------------------------------------------------------------------- collect (torch-free)


def collect(case, work: Path, settings: dict, info: dict) -> dict:
    facts = read_json(work / "facts.json") or {}
    knobs = facts.get("settings") or stage_settings(case, settings)
    stage = StageFolder.of(work / "runs" / PIPELINE_NAME, knobs["kind"])
    records = read_jsonl(stage.metrics)
    training = [r for r in records if "tokens_per_s" in r]
    warmup = case.params.get("warmup_steps", 0 if case.params.get("memory") else settings["warmup_steps"])
    measured = [r for r in training if r.get("step", 0) > warmup]
    out = {
        "stack": "project",
        "settings": knobs,
        "catalogue_gpu": facts.get("catalogue_gpu"),
        "device_line": facts.get("device_line"),
        "error": facts.get("error"),
        "steps_done": max((r.get("step", 0) for r in training), default=0),
        "steps_measured": len(measured),
        "complete": stage.result.is_file(),
    }
    out.update(_throughput(measured))
    out["sequences_per_step"] = knobs["global_batch_size"] * (2 if knobs["kind"] == "dpo" else 1)
    out["gpu_mem_peak_gib"] = _max(training, "gpu_mem_peak_gib")
    out["gpu_mem_reserved_gib"] = _max(training, "gpu_mem_reserved_gib")
    out["host_rss_gib"] = _max(training, "host_rss_gib")
    out.update(_planner(work / "plan.json"))
    data = knobs["data"]
    live_reference = knobs["kind"] == "dpo" and knobs.get("reference") in ("live", "offload")
    flops = model_flops_per_token(info, data, live_reference) if info else None
    peak = datasheet_tflops(out["catalogue_gpu"], settings["precision"])
    out["model_flops_per_token"] = flops
    out["datasheet_tflops"] = peak
    if out["tokens_per_s"] is not None and flops and peak:
        out["mfu"] = out["tokens_per_s"] * flops / (peak * 1e12)
    else:
        out["mfu"] = None
    return out


def _throughput(records: list[dict]) -> dict:
    """Real tokens/s over the measured steps (time-weighted when step_s is logged), padding, step time."""
    if not records:
        return {"tokens_per_s": None, "padding_share": None, "step_s": None, "stage_mfu": None}
    steps = [r.get("step_s") for r in records]
    rates = [r["tokens_per_s"] for r in records]
    if all(s is not None for s in steps):
        tokens_per_s = sum(r * s for r, s in zip(rates, steps, strict=True)) / sum(steps)
        step_s = sum(steps) / len(steps)
    else:
        tokens_per_s, step_s = sum(rates) / len(rates), None
    efficiency = _mean(records, "token_efficiency")
    return {
        "tokens_per_s": tokens_per_s,
        "padding_share": None if efficiency is None else 1 - efficiency,
        "step_s": step_s,
        "stage_mfu": _mean(records, "mfu"),
    }


def _planner(path: Path) -> dict:
    plan = read_json(path)
    if not plan or not plan.get("stages"):
        return {"planner_peak_gib": None, "planner_step_s": None, "planner_mfu": None, "planner_fits": None}
    stage = plan["stages"][0]
    peak = (stage.get("gpu") or {}).get("peak_bytes")
    timing = stage.get("time") or {}
    return {
        "planner_peak_gib": peak / 1024**3 if peak else None,
        "planner_step_s": timing.get("step_s"),
        "planner_mfu": timing.get("mfu"),
        "planner_fits": stage.get("fits"),
    }


def _mean(records: list[dict], key: str):
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _max(records: list[dict], key: str):
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None
