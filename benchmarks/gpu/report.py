"""Case JSONs -> the tables of benchmarks/RESULTS.md.

Reads one or more output folders of `gpu_bench.py run` (a later folder's result
for a case replaces an earlier one's), and writes one section between the
markers below; whatever else the file holds is kept. Torch-free: the report can
be regenerated anywhere from fetched JSONs.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu import slice as slice_34b
from benchmarks.gpu.cases import GROUPS, SLICE, read_json

START, END = "<!-- gpu-bench:start -->", "<!-- gpu-bench:end -->"
PREAMBLE = """# Benchmark results

The GPU benchmark (`make bench-gpu`, benchmarks/gpu_bench.py) writes the section
below; the planner-vs-DeepSpeed model-state table (CPU) is in
[plan_vs_deepspeed.md](plan_vs_deepspeed.md).

"""
NOT_CASES = {"settings.json", "workload.json"}
GOAL_RATIO = 1.3
GOAL_PADDING = 0.03
GOAL_PLANNER = 0.10
GOAL_MFU = 0.40


def load(dirs: list[Path]) -> dict:
    runs, cases, workload = [], {}, None
    for folder in dirs:
        settings = read_json(folder / "settings.json")
        if settings:
            runs.append(settings)
        workload = read_json(folder / "workload.json") or workload
        for path in sorted(folder.glob("*.json")):
            if path.name in NOT_CASES:
                continue
            record = read_json(path)
            if record and "case" in record:
                cases[record["case"]] = record
    return {"runs": runs, "cases": cases, "workload": workload}


def write(results: dict, path: Path) -> None:
    section = f"{START}\n{render(results)}\n{END}\n"
    text = path.read_text() if path.is_file() else PREAMBLE
    if START in text and END in text:
        text = text[: text.index(START)] + section + text[text.index(END) + len(END):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


# --------------------------------------------------------------------------- rendering


def render(results: dict) -> str:
    cases, runs = results["cases"], results["runs"]
    devices = {r.get("device") for r in runs}
    dry = "cpu" in devices
    lines = ["## GPU benchmark: the project's stages vs TRL, the planner vs measured memory", ""]
    if dry:
        lines += [
            "> **CPU dry run. The GPU rows are not yet measured.** The numbers below come from "
            f"`--device cpu --shape {runs[-1].get('shape')}` on a CPU: they show that every case runs end to "
            "end and that the tables fill in, and say nothing about GPU speed or memory (no GPU memory, no "
            "MFU on a CPU). The planner columns say what the planner predicts for the tiny model on a "
            "hypothetical GPU (h100-80gb unless --gpu named another), only to exercise that path.",
            "",
        ]
        if "cuda" in devices:
            lines += ["> Warning: these tables mix CPU dry-run and GPU results.", ""]
    lines += _header(results)
    lines += _throughput(cases, results)
    lines += _memory(cases)
    lines += _slice(cases, dry)
    lines += _rl(cases)
    lines += _goals(cases, results, dry)
    lines += _notes(cases)
    return "\n".join(lines).rstrip("\n")


def _header(results: dict) -> list[str]:
    cases, runs, info = results["cases"], results["runs"], results["workload"]
    env = (cases.get("env") or {}).get("facts") or {}
    matmul = cases.get("matmul") or {}
    lines = []
    if env.get("gpu_name"):
        machine = (f"{env['gpu_name']} ({env['gpu_memory_gib']:.1f} GiB, driver {env.get('driver') or '?'}, "
                   f"CUDA {env.get('torch_cuda') or '?'}, catalogue entry {env.get('catalogue_gpu') or 'none'})")
    else:
        machine = "no GPU"
    machine += f", {env.get('cpu_count', '?')} CPU cores, python {env.get('python', '?')}"
    lines.append(f"- Machine: {machine}.")
    if matmul.get("ceiling_tflops"):
        facts = matmul["facts"]
        share = matmul.get("ceiling_share_of_datasheet")
        against = (f", {100 * share:.0f}% of the {matmul['datasheet_tflops']:.0f} TFLOP/s datasheet peak"
                   if share else "")
        lines.append(f"- Measured matmul ceiling: {matmul['ceiling_tflops']:.3g} TFLOP/s "
                     f"({facts['dtype']} {facts['n']}^3 torch.matmul, median of {facts['samples']}{against}).")
    versions = env.get("versions") or {}
    if versions:
        shown = ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items())
        lines.append(f"- Versions: {shown}; project commit {env.get('git_commit') or 'unknown'}.")
    dates = sorted(c.get("finished_at", "") for c in cases.values())
    if dates:
        lines.append(f"- Date: {dates[0][:16].replace('T', ' ')} to {dates[-1][:16].replace('T', ' ')}.")
    commands = [c for run in runs for c in run.get("commands", [run.get("command")])]
    for command in dict.fromkeys(commands):
        lines.append(f"- Command: `{command}`")
    timed = sorted((c for c in cases.values() if c.get("seconds")), key=_listed)
    if timed:
        lines.append("- Wall time per case (process start to end): "
                     + ", ".join(f"{c['case']} {c['seconds']:.0f} s" for c in timed) + ".")
    if info and runs:
        run = runs[-1]
        sft, dpo = info["data"]["sft"], info["data"]["dpo"]
        lines.append(
            f"- Workload: {run['shape']} shape, random init ({_count(info['n_params'])} parameters), "
            f"{run['precision']}, attention sdpa, max_len {run['max_len']}; synthetic rows, total length lognormal "
            f"(median {sft['median_tokens']}, mean {sft['mean_tokens']:.0f}, attention-weighted "
            f"{sft['attention_length']:.0f} tokens; DPO sequences mean {dpo['mean_tokens']:.0f}); "
            f"{run['global_batch_size']} rows per optimizer step, {run['steps']} steps per throughput case, "
            f"the first {run['warmup_steps']} left out; memory cases: {run['memory_steps']} steps of 2 micro "
            f"batches on rows of exactly {run['max_len']} tokens.")
    return lines + [""]


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _listed(r: dict) -> tuple:
    """The order of the case list (names it does not hold, e.g. project-sft+packing, after)."""
    return GROUPS["all"].index(r["case"]) if r["case"] in GROUPS["all"] else len(GROUPS["all"]), r["case"]


def _order(r: dict) -> tuple:
    """SFT before DPO, the project before TRL, then the order of the case list."""
    s = r.get("settings") or {}
    return ((s.get("kind") or s.get("trainer")) != "sft", r.get("stack") != "project") + _listed(r)


def _settings(r: dict) -> str:
    s = r.get("settings") or {}
    ckpt = "ckpt on" if s.get("gradient_checkpointing") else "ckpt off"
    if r.get("stack") == "trl":
        if s.get("packing"):
            batching = (f"packing bfd, {s['per_device_train_batch_size']} packs "
                        f"x{s['gradient_accumulation_steps']}")
        elif s.get("padding_free"):
            batching = f"padding-free, {s['per_device_train_batch_size']}x{s['gradient_accumulation_steps']}"
        else:
            batching = f"padded, {s.get('per_device_train_batch_size')}x{s.get('gradient_accumulation_steps')}"
        extras = (", Liger" if s.get("liger") else "") + (", live ref" if s.get("trainer") == "dpo" else "")
        return f"{batching}, {ckpt}{extras}"
    if not s:
        return ""
    accumulation = s["global_batch_size"] // s["micro_batch_size"]
    text = f"ZeRO-{s['zero_stage']}, {ckpt}, {s['micro_batch_size']}x{accumulation}"
    if s.get("reference"):
        text += f", ref {s['reference']}"
    if s.get("lora_rank"):
        text += f", LoRA r={s['lora_rank']}"
    for key, value in (s.get("extra") or {}).items():
        text += f", {key}={value}"
    return text


def _num(value, fmt: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, fmt)


def _error(planned, measured):
    return None if planned is None or not measured else (planned - measured) / measured


def _is_throughput(r: dict) -> bool:
    return r.get("kind") in ("project", "trl") and not (r.get("params") or {}).get("memory")


THROUGHPUT_COLUMNS = [
    ("case", "---"), ("settings", "---"), ("real tok/s", "---:"), ("seq/step", "---:"), ("padding", "---:"),
    ("step s", "---:"), ("MFU datasheet", "---:"), ("MFU measured ceiling", "---:"), ("stage's own MFU", "---:"),
    ("peak alloc GiB", "---:"), ("peak reserved GiB", "---:"), ("nvidia-smi GiB", "---:"),
    ("planner GiB (vs reserved, else nvidia-smi)", "---:"), ("planner step s", "---:"),
]
MEMORY_COLUMNS = [
    ("case", "---"), ("settings", "---"), ("steps", "---:"), ("allocated GiB", "---:"), ("reserved GiB", "---:"),
    ("nvidia-smi GiB", "---:"), ("planner GiB", "---:"), ("planner vs reserved", "---:"),
    ("planner vs nvidia-smi", "---:"), ("status", "---"),
]


def _table(columns: list[tuple], rows: list[list[str]], empty: str) -> list[str]:
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "|".join(a for _, a in columns) + "|"]
    for cells in rows or [[empty] + [""] * (len(columns) - 1)]:
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _throughput(cases: dict, results: dict) -> list[str]:
    ceiling = (cases.get("matmul") or {}).get("ceiling_tflops")
    measured = [r for r in cases.values() if _is_throughput(r) and r["status"] in ("ok", "timeout", "failed")
                and r.get("tokens_per_s") is not None]
    rows = []
    for r in sorted(measured, key=_order):
        mfu = r.get("mfu")
        against_ceiling = mfu * r["datasheet_tflops"] / ceiling if mfu is not None and ceiling else None
        planner = r.get("planner_peak_gib")
        error = _error(planner, r.get("gpu_mem_reserved_gib") or r.get("device_mem_used_peak_gib"))
        planner_cell = _num(planner, ".1f") + (f" ({100 * error:+.0f}%)" if error is not None else "")
        name = r["case"] + ("" if r["status"] == "ok" else f" ({r['status']}, {r.get('steps_measured', 0)} steps)")
        rows.append([
            name, _settings(r), _num(r["tokens_per_s"], ",.0f"), _num(r.get("sequences_per_step"), ".1f"),
            _pct(r.get("padding_share")), _num(r.get("step_s"), ".3f"), _pct(mfu), _pct(against_ceiling),
            _pct(r.get("stage_mfu")), _num(r.get("gpu_mem_peak_gib"), ".1f"),
            _num(r.get("gpu_mem_reserved_gib"), ".1f"), _num(r.get("device_mem_used_peak_gib"), ".1f"),
            planner_cell, _num(r.get("planner_step_s"), ".3g"),
        ])
    lines = ["### Throughput (one GPU, same model, rows, batch and precision)", ""]
    lines += _table(THROUGHPUT_COLUMNS, rows, "(no throughput case measured)") + [""]
    dry = any(run.get("device") == "cpu" for run in results["runs"])
    for kind in ("sft", "dpo"):
        ratio = _ratio(cases, kind)
        if ratio:
            lines.append(f"- Project / best TRL, {kind.upper()}: {ratio[0]:.2f}x "
                         f"({ratio[1]} {ratio[2]:,.0f} vs {ratio[3]} {ratio[4]:,.0f} real tok/s)"
                         + (" on a CPU: not a result." if dry else "."))
    return lines + [""]


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _signed_pct(value) -> str:
    return "—" if value is None else f"{100 * value:+.1f}%"


def _ratio(cases: dict, kind: str):
    """(project / best TRL, project case, its tok/s, TRL case, its tok/s) from completed cases."""
    project = cases.get(f"project-{kind}")
    trl = [r for r in cases.values() if r.get("stack") == "trl" and (r.get("settings") or {}).get("trainer") == kind
           and r["status"] == "ok" and r.get("tokens_per_s")]
    if not project or project["status"] != "ok" or not project.get("tokens_per_s") or not trl:
        return None
    best = max(trl, key=lambda r: r["tokens_per_s"])
    return (project["tokens_per_s"] / best["tokens_per_s"], project["case"], project["tokens_per_s"],
            best["case"], best["tokens_per_s"])


def _memory(cases: dict) -> list[str]:
    rows = []
    for r in sorted((r for r in cases.values() if (r.get("params") or {}).get("memory")), key=_order):
        planner = r.get("planner_peak_gib")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r.get('reason') or '')[:80]}"
        rows.append([
            r["case"], _settings(r), str(r.get("steps_done", 0)), _num(r.get("gpu_mem_peak_gib"), ".1f"),
            _num(r.get("gpu_mem_reserved_gib"), ".1f"), _num(r.get("device_mem_used_peak_gib"), ".1f"),
            _num(planner, ".1f"), _signed_pct(_error(planner, r.get("gpu_mem_reserved_gib"))),
            _signed_pct(_error(planner, r.get("device_mem_used_peak_gib"))), status,
        ])
    lines = ["### Memory: the planner's GPU peak vs the measured peak", ""]
    return lines + _table(MEMORY_COLUMNS, rows, "(no memory case run)") + [""]


SLICE_COLUMNS = [
    ("case", "---"), ("layers", "---:"), ("parameters", "---:"), ("settings", "---"), ("steps", "---:"),
    ("step s", "---:"), ("real tok/s", "---:"), ("MFU datasheet", "---:"), ("peak alloc GiB", "---:"),
    ("peak reserved GiB", "---:"), ("host RSS GiB", "---:"), ("planner GiB", "---:"), ("planner step s", "---:"),
    ("status", "---"),
]
PER_LAYER_COLUMNS = [
    ("stage", "---"), ("layers", "---"), ("s/layer/step", "---:"), ("fixed s/step", "---:"),
    ("planner s/layer/step", "---:"), ("reserved GiB/layer", "---:"), ("fixed reserved GiB", "---:"),
    ("planner GiB/layer", "---:"), ("allocated GiB/layer", "---:"), ("host RSS GiB/layer", "---:"),
]
REDERIVED_COLUMNS = [
    ("stage", "---"), ("step s (GPU + host + comm.)", "---:"), ("real tok/s", "---:"), ("MFU", "---:"),
    ("GPU peak GiB", "---:"), ("planner step s", "---:"), ("planner tok/s", "---:"), ("planner MFU", "---:"),
    ("planner GPU peak GiB", "---:"), ("not derived", "---"),
]


def _slice(cases: dict, dry: bool) -> list[str]:
    """The 34B slice's cases, its per-layer figures and the full 34B re-derived from them."""
    names = [c.name for c in SLICE if c.kind == "slice"]
    results = [cases[n] for n in names if n in cases]
    lines = ["### 34B slice on one GPU: per layer, and the full 34B re-derived from it", ""]
    known = next((r["slice"] for r in results if (r.get("slice") or {}).get("target")), None)
    if dry:
        lines += ["> **CPU dry run: measures nothing.** The slice is a narrow stand-in (the 34B config narrowed "
                  f"to head dimension {slice_34b.CPU_HEAD_DIM}, {slice_34b.CPU_LAYERS['max']} and "
                  f"{slice_34b.CPU_LAYERS['half']} layers, fp32); the re-derivation below scales CPU seconds as if "
                  f"they were {slice_34b.DRY_GPU}'s, only to exercise the path.", ""]
    if known:
        choice = known.get("choice") or {}
        planned = "; ".join(f"{kind.upper()} GPU {v['gpu_peak_gib']:.1f} GiB, host {v['host_peak_gib']:.1f} GiB"
                            for kind, v in (choice.get("planned_at_max") or {}).items())
        full = next(iter(known["target"].values()))["layers"]
        lines.append(f"- Layers: {choice.get('max')} and {choice.get('half')} of {full}, the most the planner fits "
                     f"on {choice.get('gpu')} ({choice.get('gpu_gib')} GiB) with "
                     f"{100 * choice.get('host_margin', 0):.0f}% of {choice.get('host_gib', 0):.0f} GiB host RAM "
                     f"(planned at {choice.get('max')}: {planned})"
                     + (f". {choice['dry_run']}" if choice.get("dry_run") else "") + ".")
    lines.append(f"- Model: {slice_34b.SOURCE}'s shape from core/shapes.py with fewer layers, random init; "
                 f"settings per GPU from {slice_34b.SHIPPED} (its global batch over its GPUs), sdpa; rows of exactly "
                 f"max_len tokens; {slice_34b.STEPS} steps, the first {slice_34b.WARMUP_STEPS} left out.")
    lines.append("")
    rows = []
    for name in names:
        r = cases.get(name)
        if r is None:
            rows.append([name] + [""] * (len(SLICE_COLUMNS) - 2) + ["not measured: not run"])
            continue
        info = r.get("slice") or {}
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r.get('reason') or '')[:80]}"
        if r["status"] != "ok" and r.get("step_s") is None:
            status = "not measured: " + status
        rows.append([
            name, str(info.get("layers") or "—"), _count(info["n_params"]) if info.get("n_params") else "—",
            _settings(r), str(r.get("steps_measured", 0)), _num(r.get("step_s"), ".3f"),
            _num(r.get("tokens_per_s"), ",.0f"), _pct(r.get("mfu")), _num(r.get("gpu_mem_peak_gib"), ".1f"),
            _num(r.get("gpu_mem_reserved_gib"), ".1f"), _num(r.get("host_rss_gib"), ".1f"),
            _num(r.get("planner_peak_gib"), ".1f"), _num(r.get("planner_step_s"), ".3g"), status,
        ])
    lines += _table(SLICE_COLUMNS, rows, "") + [""]

    fits = slice_34b.per_layer(results)
    per_layer_rows = []
    for kind, fit in fits.items():
        def cell(figure, fmt, part=1, fit=fit):
            return "—" if fit.get(figure) is None else format(fit[figure][part], fmt)
        per_layer_rows.append([
            kind.upper(), " and ".join(str(n) for n in fit["layers"]) or "—", cell("step_s", ".3f"),
            cell("step_s", ".3f", 0), cell("planner_step_s", ".3f"), cell("gpu_mem_reserved_gib", ".2f"),
            cell("gpu_mem_reserved_gib", ".1f", 0), cell("planner_peak_gib", ".2f"),
            cell("gpu_mem_peak_gib", ".2f"), cell("host_rss_gib", ".2f"),
        ])
    lines += ["Per layer: the difference between the two layer counts, (y(L) - y(L/2)) / (L - L/2); fixed: "
              "what is left at 0 layers (embeddings, LM head, loss, workspace).", ""]
    lines += _table(PER_LAYER_COLUMNS, per_layer_rows, "") + [""]

    if not known:
        return lines + ["The full 34B is not re-derived: no slice case ran.", ""]
    measured_tflops = next((r.get("datasheet_tflops") for r in results if r.get("datasheet_tflops")), None)
    if dry:
        from core import hardware

        measured_tflops = hardware.gpu(slice_34b.DRY_GPU).peak_tflops("bf16")
    env = (cases.get("env") or {}).get("facts") or {}
    # beside the planner's plan of the shipped file as it is now, not as it was when the cases ran
    target = slice_34b.target_plan()
    derived = slice_34b.rederive(fits, target, measured_tflops, env.get("cpu_count"))
    plan = next(iter(target.values()))
    rederived_rows = []
    for kind, row in derived["stages"].items():
        p = row["planner"]
        parts = (f"{row['step_s']:.1f} ({row['gpu_s']:.1f} + {row['host_s']:.1f} + "
                 f"{p['exposed_communication_s']:.1f})" if row.get("step_s") is not None else "—")
        rederived_rows.append([
            kind.upper(), parts, _num(row.get("tokens_per_s"), ",.0f"), _pct(row.get("mfu")),
            _num(row.get("gpu_peak_gib"), ".1f"), _num(p.get("step_s"), ".1f"), _num(p.get("tokens_per_s"), ",.0f"),
            _pct(p.get("mfu")), _num(p.get("gpu_peak_gib"), ".1f"), "; ".join(row["notes"]) or "",
        ])
    lines += [f"The full {_count(plan['n_params'])} model ({plan['layers']} layers) on {plan['processes']}x "
              f"{plan['gpu']} as {plan['file']} runs it, re-derived from the figures above (method: "
              "benchmarks/gpu/slice.py `rederive`, and RESULTS.md's \"34B slice\" section), beside the planner's "
              f"own plan of that file (`python -m pipeline plan {plan['file']} --json`):", ""]
    lines += _table(REDERIVED_COLUMNS, rederived_rows, "") + [""]
    return lines


RL_COLUMNS = [("case", "---"), ("sequences x max new", "---"), ("s / rollout", "---:"), ("generate s", "---:"),
              ("of it gather s", "---:"), ("score s", "---:"), ("train s", "---:"), ("other s", "---:"),
              ("generated tok/s", "---:"), ("of bandwidth limit", "---:"),
              ("GPU busy: generate / score / train", "---:"), ("mean length", "---:")]


def _rl(cases: dict) -> list[str]:
    """The RL group (benchmarks/gpu/rl.py): a GRPO rollout's phases, means over the measured rollouts."""
    rows = [r for r in cases.values() if r.get("kind") == "rl"]
    if not rows:
        return []
    lines = ["### RL: one GRPO rollout and its update (one GPU)", ""]
    table = []
    for r in rows:
        k = r.get("settings") or {}
        busy = " / ".join(_pct(r.get(f"gpu_busy_{p}")) for p in ("generate", "score", "train"))
        table.append([r["case"], f"{k.get('prompts_per_rollout', 0) * k.get('samples_per_prompt', 0)} x "
                      f"{k.get('max_new_tokens')}", _num(r.get("rollout_s"), ".2f"), _num(r.get("generate_s"), ".2f"),
                      _num(r.get("gather_s"), ".3f"), _num(r.get("score_s"), ".2f"), _num(r.get("train_s"), ".2f"),
                      _num(r.get("other_s"), ".3f"), _num(r.get("generate_tokens_per_s"), ",.0f"),
                      _pct(r.get("generate_bandwidth_fraction")), busy, _num(r.get("response_length"), ".0f")])
    lines += _table(RL_COLUMNS, table, "(no RL case measured)")
    lines.append("")
    project, trl = (cases.get(name) or {} for name in ("project-grpo", "trl-grpo"))
    if project.get("rollout_s") and trl.get("rollout_s"):
        lines.append(f"- Project / TRL, whole GRPO step: {trl['rollout_s'] / project['rollout_s']:.2f}x as fast "
                     f"({project['rollout_s']:.2f} vs {trl['rollout_s']:.2f} s; goal >= 1.5x on a GPU)")
    else:
        lines.append("- Project / TRL, whole GRPO step: **not measured**")
    return lines + ["- Means over the rollouts (TRL: optimizer steps) after the first, which compiles or warms up; "
                    "TRL's phases other than generation are not timed apart (—); busy shares and the bandwidth "
                    "share are null without a GPU (—).", ""]


def _goals(cases: dict, results: dict, dry: bool) -> list[str]:
    lines = ["### Goals", ""]
    if dry:
        return lines + ["Not evaluated: a CPU dry run says nothing about them. The GPU rows are not yet measured.", ""]

    def line(met, text):
        mark = {True: "met", False: "NOT met", None: "not measured"}[met]
        lines.append(f"- {text}: **{mark}**")

    for kind in ("sft", "dpo"):
        ratio = _ratio(cases, kind)
        line(None if ratio is None else ratio[0] >= GOAL_RATIO,
             f"project {kind.upper()} real tokens/s >= {GOAL_RATIO}x TRL's best"
             + (f" ({ratio[0]:.2f}x vs {ratio[3]})" if ratio else ""))
    padded = [(r["case"], r["padding_share"]) for r in cases.values()
              if r.get("stack") == "project" and _is_throughput(r) and r.get("padding_share") is not None
              and (r.get("settings") or {}).get("extra", {}).get("packing", True)]  # packing: false pads on purpose
    line(None if not padded else all(round(p, 4) <= GOAL_PADDING for _, p in padded),
         f"project padding share <= {100 * GOAL_PADDING:.0f}% (with packing)"
         + (" (" + ", ".join(f"{c} {100 * p:.1f}%" for c, p in padded) + ")" if padded
            else " (the stages do not log token_efficiency yet)"))
    matrix = [r for r in cases.values() if (r.get("params") or {}).get("memory") and r["status"] == "ok"]
    measure = "reserved peak"
    if matrix and all(r.get("gpu_mem_reserved_gib") is None for r in matrix):
        # the stages do not log torch's numbers yet: nvidia-smi's (CUDA context included) stand in
        measure = "nvidia-smi peak (the stages log no reserved peak yet)"
        matrix = [{**r, "gpu_mem_reserved_gib": r.get("device_mem_used_peak_gib")} for r in matrix]
    errors = [(r["case"], _error(r.get("planner_peak_gib"), r.get("gpu_mem_reserved_gib"))) for r in matrix]
    errors = [(c, e) for c, e in errors if e is not None]
    worst = max(errors, key=lambda ce: abs(ce[1])) if errors else None
    asked = [r for r in cases.values() if (r.get("params") or {}).get("memory")]
    whole = errors and len(errors) == len(asked)  # a matrix with holes is not the matrix
    line(None if not whole else all(round(abs(e), 4) <= GOAL_PLANNER for _, e in errors),
         f"planner GPU peak within +-{100 * GOAL_PLANNER:.0f}% of the measured {measure} over the matrix"
         + (f" ({len(errors)} of {len(asked)} rows measured, worst {worst[0]} {100 * worst[1]:+.1f}%)"
            if worst else ""))
    run = results["runs"][-1] if results["runs"] else {}
    sft = cases.get("project-sft") or {}
    on_h100 = (sft.get("catalogue_gpu") or "").startswith("h100")
    applies = on_h100 and run.get("shape") == "llama-3.2-1b" and run.get("max_len") == 2048
    mfu = sft.get("mfu") if sft.get("status") == "ok" else None
    line(None if not applies or mfu is None else mfu >= GOAL_MFU,
         f"project SFT step MFU >= {100 * GOAL_MFU:.0f}% on H100, 1B shape, 2048 tokens"
         + (f" ({100 * mfu:.1f}%)" if mfu is not None else "") + ("" if applies else " (not this machine or shape)"))
    return lines + [""]


def _notes(cases: dict) -> list[str]:
    lines = ["### Not measured, and why", ""]
    missing = [r for r in cases.values() if r["status"] != "ok" and r.get("kind") != "env"]
    for r in sorted(missing, key=lambda r: r["case"]):
        lines.append(f"- {r['case']}: {r['status']}: {r.get('reason') or 'no reason recorded'}")
    if not missing:
        lines.append("- nothing: every case that was asked for ran")
    lines += [
        "",
        "### How the numbers are made",
        "",
        "- Settings: `4x8` is micro batch x gradient accumulation, one process (32 rows a step); TRL's "
        "`packing bfd, M packs xN`: micro batches of M packs of up to max_len tokens (the project's token "
        "budget per pass), M x N packs a step chosen to hold the tokens of 32 average rows; seq/step counts "
        "the sequences actually trained on.",
        "- Real tokens: prompt and response tokens of every sequence (chosen and rejected both for DPO), "
        "<s> and </s> included, no padding; the project's count comes from its metrics.jsonl, TRL's from "
        "the micro batches the trainer actually trained on (`input_ids != <pad>`). Padding share: 1 - real "
        "/ processed tensor elements. Real tok/s: real tokens over wall time of the measured optimizer steps.",
        "- MFU: real tok/s x model FLOPs per token / peak, model FLOPs = 6N + 12 x layers x q_width x s "
        "(N: matmul parameters, s: the data's attention-weighted length), plus a live reference's forward "
        "(2N + 4 x layers x q_width x s) for DPO; recompute not counted (the planner's convention). "
        "\"datasheet\": against core/hardware.py's dense bf16 peak; \"measured ceiling\": against the "
        "matmul case. \"stage's own MFU\": what the stage logs itself.",
        "- Memory: peak allocated / reserved from torch.cuda (the project: max of its per-record "
        "`gpu_mem_peak_gib` / `gpu_mem_reserved_gib`; TRL: since its process started); nvidia-smi: the "
        "largest memory.used sampled every 0.5 s while the case ran (CUDA context included). Planner: "
        "`python -m pipeline plan --json`, stages[0].gpu.peak_bytes, a worst-case (max_len rows) estimate.",
        "- TRL runs with its own speed options per variant (padding-free, bfd packing, Liger when "
        "installed), completion-only loss, TRL's default precision (fp32 master weights, bf16 autocast) and "
        "optimizer; see benchmarks/gpu/hf_trl.py.",
    ]
    return lines + [""]
