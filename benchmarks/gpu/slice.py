"""A slice of the real 34B on one GPU, through the project's own SFT and DPO stages (issue 20).

The model is core/shapes.py's CodeLlama-34B (hidden 8192, MLP 22016, 64 query / 8
key-value heads, vocabulary 32000) with only L of its 48 layers, positions capped at
max_len, random init. It trains with the per-GPU settings of the shipped 8x A100 file
(pipeline/configs/llama34b_dpo_8xa100.yaml: bf16, ZeRO-3, optimizer offload, gradient
checkpointing, micro batch 1, max_len, DPO reference precompute; its global batch divided
by its GPUs, so one GPU here does the work one of its 8 GPUs does per step), attention sdpa.
Rows are exactly max_len tokens, as the planner assumes, so every step is the same work.

L: the largest layer count whose planned GPU peak fits this GPU and whose planned host
memory (the offloaded optimizer, ~18 bytes/param) fits HOST_MARGIN of this machine's RAM,
for both stages (the planner in-process, pipeline/plan). Each stage is measured at L and
at L // 2, so figures per layer are differences: (y(L) - y(L/2)) / (L - L/2), which
separates the fixed cost (embeddings, LM head, loss) from the per-layer cost.

The full 34B on the shipped 8x A100 file is then re-derived from the measured figures
(`rederive`; the method is stated there and in benchmarks/RESULTS.md) and shown beside
the planner's own plan of that file.

On a CPU (the dry run) the slice is a narrow stand-in: the same config narrowed by
pipeline/scale.py's `narrowed` to head dimension 2 (hidden 128, MLP in proportion), 2 and
1 layers, fp32: it proves the path end to end and measures nothing.

The case body (`run`) needs the project's packages; `collect` and the maths are torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.cases import Case, catalogue_gpu, nvidia_smi, read_json

SOURCE = "codellama/CodeLlama-34b-hf"  # core/shapes.py's built-in shape: the one owner of its sizes
SHIPPED = "llama34b_dpo_8xa100.yaml"  # whose per-GPU settings the slice trains with
HOST_MARGIN = 0.8  # of MemTotal: the page cache of the model files, the bench's own processes
STEPS, WARMUP_STEPS = 4, 1  # optimizer steps per case; the first is left out of the timings
CPU_LAYERS = {"max": 2, "half": 1}
CPU_HEAD_DIM = 2
DRY_GPU, DRY_HOST_GIB = "h100-80gb", 128  # what the dry run plans the layer choice for (GPU.md's machine)
MODEL_STATES = ("weights", "gradients", "optimizer")  # the planner's item categories that are model states
GiB = 1024**3


# --------------------------------------------------------------------------- the slice and its settings


def shipped() -> dict:
    """Per stage kind of the shipped file: its Knobs, its processes and its GPU."""
    from core.config import load_pipeline
    from pipeline.plan.inputs import Hardware, Knobs

    spec = load_pipeline(SHIPPED)
    hw = Hardware.from_cluster(spec.cluster)
    return {stage.kind: {"knobs": Knobs.from_stage(stage), "world": stage.nodes * hw.processes_per_node,
                         "gpu": hw.gpu.name if hw.gpu else None} for stage in spec.stages}


def per_gpu_knobs(entry: dict):
    """The shipped stage's settings for one GPU's share: its global batch over its GPUs, sdpa
    (no flash-attn on the benchmark machine), STEPS optimizer steps."""
    knobs = entry["knobs"]
    return dataclasses.replace(knobs, attention="sdpa", global_batch_size=knobs.global_batch_size // entry["world"],
                               max_steps=STEPS, epochs=1)


def source_shape():
    from core.shapes import BUILTIN_SHAPES

    return BUILTIN_SHAPES[SOURCE]


def slice_shape(layers: int, max_len: int):
    return dataclasses.replace(source_shape(), layers=layers, max_positions=max_len, source="")


def slice_config(layers: int, max_len: int, head_dim: int | None = None) -> dict:
    """config.json of the slice; with head_dim, the narrow stand-in pipeline/scale.py builds."""
    from core.shapes import to_config_json

    config = to_config_json(slice_shape(layers, max_len))
    if head_dim:
        from pipeline.scale import narrowed

        config = narrowed(config, head_dim, "the 34B slice's CPU stand-in")
    return config


def choose_layers(gpu_name: str, host_bytes: int, max_len: int) -> dict:
    """The largest layer count (at most the real model's) whose planned GPU peak fits the GPU
    and whose planned host peak fits HOST_MARGIN of host_bytes, for every stage of the shipped
    file; and half of it, the second point of the per-layer differences."""
    from core import hardware
    from pipeline.plan.estimate import estimate_stage
    from pipeline.plan.inputs import Hardware

    gpu = hardware.gpu(gpu_name)
    hw = Hardware(gpu, 1, 1, gpu.memory_bytes, int(host_bytes * HOST_MARGIN), f"{HOST_MARGIN:.0%} of MemTotal")
    stages = {kind: per_gpu_knobs(entry) for kind, entry in shipped().items()}
    stages = {kind: dataclasses.replace(knobs, max_len=max_len) for kind, knobs in stages.items()}
    planned = {}
    for layers in range(source_shape().layers, 0, -1):
        estimates = {kind: estimate_stage(knobs, slice_shape(layers, max_len), hw) for kind, knobs in stages.items()}
        planned = {kind: {"gpu_peak_gib": e.memory.gpu_peak / GiB, "host_peak_gib": e.memory.host_peak / GiB}
                   for kind, e in estimates.items()}
        if all(e.fits for e in estimates.values()):
            return {"max": layers, "half": max(1, layers // 2), "gpu": gpu.name, "gpu_gib": gpu.memory_gib,
                    "host_gib": host_bytes / GiB, "host_margin": HOST_MARGIN, "planned_at_max": planned}
    raise SystemExit(f"not even one layer of {SOURCE} fits {gpu.name} with {host_bytes / GiB:.0f} GiB of host RAM "
                     f"(planned for 1 layer: {planned})")


def host_memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("cannot read MemTotal from /proc/meminfo")


def target_plan() -> dict:
    """The planner's own plan of the shipped file, per stage kind: what the re-derivation needs
    from it and what is printed beside it."""
    from core import hardware
    from core.config import load_pipeline
    from pipeline import plan
    from pipeline.plan import rates

    spec = load_pipeline(SHIPPED)
    cores = spec.cluster.cpus_per_task or rates.DEFAULT_CORES_PER_PROCESS
    out = {}
    for stage in plan.plan_to_json(plan.plan_pipeline(spec, plan.known_rows(spec)))["stages"]:
        timing = stage.get("time") or {}
        out[stage["kind"]] = {
            "file": SHIPPED, "gpu": stage["gpu_name"], "processes": stage["processes"],
            "layers": stage["shape"]["layers"], "n_params": stage["shape"]["n_params"],
            "peak_tflops": hardware.gpu(stage["gpu_name"]).peak_tflops(stage["settings"]["precision"]),
            "gpu_peak_gib": stage["gpu"]["peak_bytes"] / GiB, "host_peak_gib": stage["host"]["peak_bytes"] / GiB,
            "model_states_gib": model_states_gib(stage),
            "step_s": timing.get("step_s"), "tokens_per_step": timing.get("tokens_per_step"),
            "cores_per_process": cores,
            "tokens_per_s": timing.get("tokens_per_s"), "mfu": timing.get("mfu"),
            "model_flops_per_token": timing.get("model_flops_per_token"),
            "exposed_communication_s": timing.get("exposed_communication_s") or 0.0,
        }
    return out


def model_states_gib(stage_plan: dict) -> float:
    """The GPU bytes of a planned stage's model states (weights, gradients, optimizer that stay
    on the GPU the whole run), from its `plan --json` items."""
    return sum(i["bytes"] for i in stage_plan["items"]
               if i["where"] == "gpu" and i["phase"] == "always" and i["category"] in MODEL_STATES) / GiB


# --------------------------------------------------------------------------- the case body


def run(case: Case, work: Path, settings: dict) -> None:
    """Choose L, build (or reuse) the slice's workload, run the project's stage on it
    (benchmarks/gpu/project.py), leaving slice.json beside the stage's facts."""
    from benchmarks.gpu import project

    on_gpu = settings["device"] == "cuda"
    kind, role = case.params["kind"], case.params["layers"]
    entry = shipped()[kind]
    knobs = per_gpu_knobs(entry)
    max_len = knobs.max_len if on_gpu else settings["max_len"]
    facts = {"kind": kind, "role": role, "max_len": max_len, "target": target_plan()}
    if on_gpu:
        gpu = settings.get("gpu") or catalogue_gpu(nvidia_smi("name"))
        if gpu is None:
            raise SystemExit(f"the GPU '{nvidia_smi('name')}' is not in core/hardware.py: name it with --gpu")
        facts["choice"] = choose_layers(gpu, host_memory_bytes(), max_len)
        layers, head_dim = facts["choice"][role], None
    else:
        facts["choice"] = choose_layers(DRY_GPU, DRY_HOST_GIB * GiB, knobs.max_len)
        facts["choice"]["dry_run"] = (f"The dry run only plans that choice; its stand-in runs {CPU_LAYERS['max']} "
                                      f"and {CPU_LAYERS['half']} layers")
        layers, head_dim = CPU_LAYERS[role], CPU_HEAD_DIM
    facts.update(layers=layers, stand_in=f"head dim {head_dim}" if head_dim else None)
    print(f"slice: {layers} layers ({role}); choice {json.dumps(facts['choice'])}", flush=True)

    name = f"codellama-34b-slice-{layers}l" + (f"-hd{head_dim}" if head_dim else "")
    rows = knobs.global_batch_size * (STEPS + 4)
    folder = Path(settings["work"]) / "slice-34b" / name
    config = slice_config(layers, max_len, head_dim)
    facts["workload"] = str(folder)
    _write(work, facts)
    # In a child process: this one waits beside the stage, and must hold neither the model's host
    # memory nor a CUDA context (~0.5 GiB of the GPU the stage is measured on) meanwhile.
    request = {"folder": str(folder), "name": name, "max_len": max_len, "rows": rows, "config": config,
               "dtype": settings["precision"], "device": settings["device"]}
    subprocess.run([sys.executable, "-m", "benchmarks.gpu.slice", json.dumps(request)], check=True,
                   cwd=Path(__file__).resolve().parents[2])
    info = read_json(folder / "workload.json")
    facts["params"] = {
        "kind": kind, "data": f"{kind}-full", "zero_stage": knobs.zero_stage,
        "gradient_checkpointing": knobs.gradient_checkpointing, "micro_batch_size": knobs.micro_batch_size,
        "global_batch_size": knobs.global_batch_size, "max_steps": STEPS, "warmup_steps": WARMUP_STEPS,
        "max_len": max_len, "reference": knobs.reference if kind == "dpo" else None,
        "extra": {"optimizer_offload": knobs.optimizer_offload},
    }
    facts["n_params"] = info["n_params"]
    _write(work, facts)
    project.run(Case(case.name, "project", facts["params"]), work, settings, info)


def _write(work: Path, facts: dict) -> None:
    (work / "slice.json").write_text(json.dumps(facts, indent=2) + "\n")


# --------------------------------------------------------------------------- collect (torch-free)


def collect(case: Case, work: Path, settings: dict) -> dict:
    from benchmarks.gpu import project

    facts = read_json(work / "slice.json") or {}
    base = {"slice": {k: facts.get(k) for k in ("kind", "role", "layers", "n_params", "stand_in", "max_len",
                                                 "choice", "target")}}
    if not facts.get("params"):
        return {**base, "complete": False, "error": "the slice's workload was not built (see its log)"}
    info = read_json(Path(facts["workload"]) / "workload.json")
    out = project.collect(Case(case.name, "project", facts["params"]), work, settings, info)
    plan = read_json(work / "plan.json")
    base["slice"]["planner_model_states_gib"] = model_states_gib(plan["stages"][0]) if plan else None
    if out.get("tokens_per_s") is not None and out.get("step_s") is not None:
        base["slice"]["tokens_per_step"] = out["tokens_per_s"] * out["step_s"]
    return {**out, **base}


# --------------------------------------------------------------------------- the maths (torch-free)


def line(points: list[tuple[float, float | None]]) -> tuple[float, float] | None:
    """(fixed, per layer) of y = fixed + per_layer x layers through the points (least squares
    over more than two); None with fewer than two distinct layer counts or a missing y."""
    if any(y is None for _, y in points):
        return None
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


FIGURES = ("step_s", "gpu_mem_peak_gib", "gpu_mem_reserved_gib", "host_rss_gib", "rest_gib", "planner_step_s",
           "planner_peak_gib", "tokens_per_step")


def per_layer(results: list[dict]) -> dict:
    """kind -> {figure: (fixed, per layer) or None, "layers": [...]} from the slice cases with
    training steps measured. rest_gib: reserved peak minus the planner's model states (on one
    GPU ZeRO-3 shards nothing: all the weights), i.e. activations, buffers, workspace."""
    out = {}
    for kind in ("sft", "dpo"):
        rows = [r for r in results if (r.get("slice") or {}).get("kind") == kind and r.get("step_s") is not None]
        points = {figure: [] for figure in FIGURES}
        for r in rows:
            layers = r["slice"]["layers"]
            states = r["slice"].get("planner_model_states_gib")
            reserved = r.get("gpu_mem_reserved_gib")
            values = {**{f: r.get(f) for f in FIGURES}, "tokens_per_step": r["slice"].get("tokens_per_step"),
                      "rest_gib": None if reserved is None or states is None else reserved - states}
            for figure in FIGURES:
                points[figure].append((layers, values[figure]))
        fits = {figure: line(p) for figure, p in points.items()}
        tokens = [y for _, y in points["tokens_per_step"] if y is not None]
        fits["tokens_per_step"] = sum(tokens) / len(tokens) if tokens else None
        out[kind] = {"layers": sorted({r["slice"]["layers"] for r in rows}), **fits}
    return out


def rederive(fits: dict, target: dict, measured_tflops: float | None, measured_cores: int | None) -> dict:
    """The full model's step on the shipped file's GPUs, per stage kind, from the measured slice.

    A step is GPU work, proportional to the tokens of the step, plus host work (the offloaded
    optimizer's Adam and the gradient / parameter copies), proportional to the parameters and not
    to the tokens. DPO steps carry twice SFT's tokens (chosen and rejected rows of max_len) for the
    same parameters, so at each layer count
        gpu seconds per token  g = (t_dpo - t_sft) / (T_dpo - T_sft),   host seconds  H = t_sft - g T_sft
    and, fixed + per layer, g = g0 + g1 L, H = H0 + H1 L. On the target each of its N GPUs runs
    its share of the global batch (T_target / N tokens; the slice ran exactly that share) over
    all its layers, at the datasheet peak ratio of the measured GPU to the target's; its process
    steps 1/N of the parameters on the host with its own share of the node's cores (the plan's
    cores per process) where the slice's one process had all `measured_cores`:
        step = (g0 + g1 L_full) (T_target / N) (peak_measured / peak_target)
               + (H0 + H1 L_full) / N x measured_cores / target cores per process
               + the planner's exposed communication of the target (ZeRO-3 gathers between GPUs,
                 which one GPU cannot measure)
    tokens/s = T_target / step; MFU = tokens/s x the planner's model FLOPs per token / (N x peak).
    Assumed, not measured: the target's CPU cores as fast as the measured machine's, and its 8
    processes not slowed by sharing the node's memory bandwidth.

    The GPU peak is not derived: with one process ZeRO-3 partitions nothing, so what the slice
    holds beside the model states is whole weights gathered and cached, which at N ranks are
    1/N partitions; one GPU cannot tell that part (the planner's memory model, checked against
    these records at one process, stands).
    """
    out = {}
    sft, dpo = fits.get("sft") or {}, fits.get("dpo") or {}
    split = None
    if sft.get("step_s") and dpo.get("step_s") and sft.get("tokens_per_step") and dpo.get("tokens_per_step"):
        spread = dpo["tokens_per_step"] - sft["tokens_per_step"]
        if spread > 0:
            (a_s, b_s), (a_d, b_d) = sft["step_s"], dpo["step_s"]
            g0, g1 = (a_d - a_s) / spread, (b_d - b_s) / spread
            split = {"gpu_s_per_token": (g0, g1),
                     "host_s": (a_s - g0 * sft["tokens_per_step"], b_s - g1 * sft["tokens_per_step"])}
    for kind, plan in target.items():
        row: dict = {"planner": plan, "notes": ["GPU peak: one GPU cannot tell ZeRO-3's share at "
                                                f"{plan['processes']} ranks (the plan's stands)"]}
        full, world = plan["layers"], plan["processes"]
        if split is None:
            row["notes"].append("step time: needs slice-34b-sft and slice-34b-dpo at both layer counts")
        elif not measured_tflops:
            row["notes"].append("step time: the measured GPU has no datasheet peak (core/hardware.py)")
        elif not measured_cores:
            row["notes"].append("step time: the measuring machine's CPU cores are not on record (env case)")
        else:
            g0, g1 = split["gpu_s_per_token"]
            h0, h1 = split["host_s"]
            gpu_s = (g0 + g1 * full) * plan["tokens_per_step"] / world * measured_tflops / plan["peak_tflops"]
            host_s = (h0 + h1 * full) / world * measured_cores / plan["cores_per_process"]
            if min(gpu_s, host_s) < 0:
                row["notes"].append(f"step time: the split gives a negative part (GPU {gpu_s:.3g} s, host "
                                    f"{host_s:.3g} s): the measured differences are within the noise")
            else:
                step = gpu_s + host_s + plan["exposed_communication_s"]
                row.update(gpu_s=gpu_s, host_s=host_s, step_s=step, tokens_per_s=plan["tokens_per_step"] / step)
                if plan.get("model_flops_per_token"):
                    row["mfu"] = (row["tokens_per_s"] * plan["model_flops_per_token"]
                                  / (world * plan["peak_tflops"] * 1e12))
        out[kind] = row
    return {"split": split, "stages": out}


def _build(request: dict) -> None:
    """The slice's workload (model, tokenizer, rows), as `run` asks for it in a child process."""
    from benchmarks.gpu import workload

    wanted = workload.describe(request["name"], request["max_len"], request["rows"], request["dtype"])
    workload.build(Path(request["folder"]), wanted, request["config"], request["max_len"] // 4, request["device"])


if __name__ == "__main__":
    _build(json.loads(sys.argv[1]))
