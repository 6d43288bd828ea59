"""The plan as people read it (format_plan) and as programs read it (plan_to_json):
the same numbers, the text in GiB and readable durations, the JSON in bytes and seconds."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from core.shapes import count_text
from pipeline.plan.batches import Batches
from pipeline.plan.estimate import Estimate
from pipeline.plan.inputs import GiB
from pipeline.plan.memory import Memory
from pipeline.plan.timing import TimeEstimate

if TYPE_CHECKING:
    from pipeline.plan.fixes import Suggestion
    from pipeline.plan.planner import StagePlan


def _gib(n: float | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def _size(n: float) -> str:
    """Item sizes: GiB for big ones, MiB for the small ones a tiny model has."""
    return f"{n / GiB:10.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / 2**20:10.2f} MiB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def shortfall_text(memory: Memory) -> str:
    parts = []
    if memory.gpu_headroom is not None and memory.gpu_headroom < 0:
        parts.append(f"GPU needs {_gib(memory.gpu_peak)} of {_gib(memory.gpu_capacity)}, "
                     f"{_gib(-memory.gpu_headroom)} short")
    if memory.host_headroom is not None and memory.host_headroom < 0:
        parts.append(f"host RAM needs {_gib(memory.host_peak)} of {_gib(memory.host_capacity)} per node, "
                     f"{_gib(-memory.host_headroom)} short")
    return "; ".join(parts) or "fits"


def _verdict(memory: Memory) -> str:
    if memory.fits is None:
        return "not checked (no GPU type or memory size known)"
    if memory.fits:
        parts = []
        if memory.gpu_headroom is not None:
            parts.append(f"{_gib(memory.gpu_headroom)} spare per GPU")
        if memory.host_headroom is not None:
            parts.append(f"{_gib(memory.host_headroom)} spare host RAM per node")
        return "FITS: " + ", ".join(parts)
    return "DOES NOT FIT: " + shortfall_text(memory)


def _summary(estimate: Estimate) -> str:
    m, t = estimate.memory, estimate.time
    text = f"GPU {_gib(m.gpu_peak) if m.gpu_capacity is not None else '-'}, host {_gib(m.host_peak)}/node"
    if t is not None:
        text += f", {_duration(t.seconds_per_1000_rows)}/1000 rows, MFU {t.mfu:.0%}"
    return text


def format_plan(plans: list[StagePlan]) -> str:
    """A readable report: per stage the itemised memory, verdict, suggestions and time."""
    out: list[str] = []
    for plan in plans:
        out += _setting_lines(plan)
        if plan.estimate.batches is not None:
            out += _batches_text(plan.estimate.batches, plan.knobs.max_len)
        out += _memory_lines(plan.memory)
        out.append(f"   verdict: {_verdict(plan.memory)}")
        if plan.hardware.on_gpu:
            out.append(f"   memory checked: {_memory_confidence(plan)}")
        if plan.time is not None:
            out += _time_lines(plan.time)
        out += _advice_lines(plan)
        out.append("")
    return "\n".join(out)


def _setting_lines(plan: StagePlan) -> list[str]:
    """Where the stage runs, its model and the settings the estimate is for."""
    out: list[str] = []
    k, hw = plan.knobs, plan.hardware
    gpu_name = hw.gpu.name if hw.gpu else ("CPU" if not hw.on_gpu else "unknown GPU")
    sharing = (f" (sequence_parallel {k.sequence_parallel}: {plan.data_parallel} data-parallel groups of "
               f"{k.sequence_parallel} sharing each sequence)" if k.sequence_parallel > 1 else "")
    out.append(f"== stage '{plan.stage}' ({plan.kind}) on {k.nodes} node{'s' if k.nodes > 1 else ''} x "
               f"{hw.processes_per_node} {gpu_name} = {plan.world} processes{sharing}")
    out.append(f"   model {plan.model}: {plan.shape.describe()}")
    lora = f", LoRA r={k.lora_rank}" if k.lora_rank else ""
    ref = f", reference {k.reference or 'none (kl_coef 0)'}" if k.stage_kind.frozen_reference else ""
    out.append(f"   {k.precision}, ZeRO-{k.zero_stage}{' + optimizer offload' if k.offloads else ''}"
               f"{', gradient checkpointing' if k.gradient_checkpointing else ''}"
               f"{' (inputs offloaded to the host)' if k.checkpoint_offload else ''}, attention {k.attention}{lora}"
               f"{ref}, max_len {k.max_len}, micro batch {k.micro_batch_size}")
    out.append(f"   trained parameters {count_text(plan.trained_params)} of {count_text(plan.total_params)} held")
    return out


def _memory_lines(m: Memory) -> list[str]:
    """GPU memory per GPU and host RAM per node: each peak, and the items phase by phase."""
    out: list[str] = []
    for where, title, capacity in (("gpu", "GPU memory per GPU", m.gpu_capacity),
                                   ("host", "host RAM per node", m.host_capacity)):
        rows = [i for i in m.items if i.where == where]
        if not rows:
            continue
        peak, phase = m.peak(where)
        source = f" ({m.host_capacity_source})" if where == "host" and m.host_capacity_source else ""
        moment = "at rest" if phase == "always" else f"during {phase}"
        out.append(f"   {title}: peak {_gib(peak)} {moment}, available {_gib(capacity)}{source}")
        for phase_name in ["always"] + sorted({i.phase for i in rows} - {"always"}):
            for item in (i for i in rows if i.phase == phase_name):
                tag = "" if phase_name == "always" else f"  [{phase_name}]"
                out.append(f"     {_size(m.total_bytes(item))}  {item.name}{tag}")
    return out


def _time_lines(t: TimeEstimate) -> list[str]:
    """The time of a step or rollout, its terms, the total and where each rate comes from."""
    out: list[str] = []
    out.append(f"   time: {t.rows_per_step} rows = {t.tokens_per_step:,.0f} tokens per {t.unit}, "
               f"{t.flops_per_token / 1e9:.1f} GFLOP/token executed, GPU busy {t.hfu:.0%} of peak in compute")
    exchange = (f" (sequence exchange {_duration(t.sequence_exchange_s)})" if t.sequence_exchange_s else "")
    terms = ", ".join(f"{name} {_duration(seconds)}" for name, seconds in t.compute_terms.items() if seconds)
    out.append(f"         {t.unit} {_duration(t.step_s)} (compute {_duration(t.compute_s)}: {terms}; optimizer "
               f"{_duration(t.optimizer_s)}, communication {_duration(t.communication_s)}{exchange} of which exposed "
               f"{_duration(t.exposed_communication_s)}, offload {_duration(t.offload_s)}): "
               f"{t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.0%}")
    total = (f"{t.steps} steps = {_duration(t.total_s)}" if t.total_s is not None
             else "rows unknown: give rows for a total")
    pre = f" (incl. {_duration(t.precompute_s_per_1000_rows)} reference precompute)" \
        if t.precompute_s_per_1000_rows else ""
    out.append(f"         {_duration(t.seconds_per_1000_rows)} per 1000 rows{pre}; {total}")
    rates = t.calibration or "built in (no calibration file for this GPU: python -m pipeline calibrate)"
    out.append(f"         rates: {rates}")
    for source in t.sources:
        out.append(f"           {source}")
    return out


def _advice_lines(plan: StagePlan) -> list[str]:
    """The plan's warnings, what each chosen setting saves, and the suggestions that would fit."""
    out: list[str] = []
    for warning in plan.warnings:
        out.append(f"   warning: {warning}")
    if plan.without:
        out.append("   why these settings (the stage re-estimated without each):")
        for s in plan.without:
            out.append(f"     {s.description}")
            out.append(f"        -> {_verdict(s.estimate.memory)}; {_summary(s.estimate)}")
    if plan.suggestions:
        fitting = any(s.estimate.fits for s in plan.suggestions)
        out.append("   would fit with (cheapest first):" if fitting else "   nothing tried fits; closest:")
        for n, s in enumerate(plan.suggestions, 1):
            flag = " [changes the training]" if s.changes_training else ""
            out.append(f"     {n}. {s.description}{flag}")
            out.append(f"        -> {_verdict(s.estimate.memory)}; {_summary(s.estimate)}")
    return out


def _memory_confidence(plan: StagePlan) -> str:
    """What the GPU memory estimate rests on, for the settings of this stage."""
    k = plan.knobs
    text = ("model states as DeepSpeed allocates them (tests/test_plan_vs_deepspeed.py); the passes, "
            "buffers and the allocator's reserve against the GPU records (benchmarks/results), all of them "
            "one process")
    unchecked = []
    if plan.world > 1:
        unchecked.append(f"ZeRO-{k.zero_stage}'s buffers across {plan.world} processes")
    if k.attention == "flash_attention_2" or (k.attention == "auto"):
        unchecked.append("flash attention")
    if k.stage_kind.rollouts:
        unchecked.append("rollout generation")
    if k.sequence_parallel > 1:
        unchecked.append(f"sequences shared by {k.sequence_parallel} processes")
    return text + (f"; not checked by a record: {', '.join(unchecked)}" if unchecked else "")


def _batches_text(b: Batches, max_len: int) -> list[str]:
    """Where the rows' lengths came from, and what the step's micro batches hold."""
    lengths = b.lengths
    if lengths is not None and lengths.sampled:
        per_row = "tokens per row" + (" (a pair: both sequences)" if len(lengths.rows[0]) > 1 else "")
        text = (f"   lengths: {lengths.describe()}: mean {b.mean_row_tokens:,.0f} {per_row}, "
                f"p95 {b.p95_row_tokens:,} (max_len {max_len} per sequence)")
    else:
        text = f"   lengths: {lengths.describe() if lengths is not None else 'max_len assumed per row'}"
    layout = (f"packed, up to {b.token_budget:,} tokens per micro batch" if b.packed
              else "padded to each micro batch's longest row")
    n = b.sequence_parallel
    shared = f", each shared by {n} processes (1/{n} of its positions each)" if n > 1 else ""
    return [text, f"   batches: {layout}{shared}; {b.micro_batches_per_step:.1f} micro batches per step per process, "
                  f"{b.padding_share:.1%} padding"]


def _batches_json(b: Batches | None) -> dict | None:
    if b is None:
        return None
    lengths = b.lengths
    sampled = lengths if lengths is not None and lengths.sampled else None  # lengths counted from rows
    return {
        "packed": b.packed, "token_budget": b.token_budget, "rows_per_step": b.rows_per_step,
        "sequence_parallel": b.sequence_parallel,
        "micro_batches_per_step": b.micro_batches_per_step, "real_tokens_per_step": b.real_tokens_per_step,
        "processed_tokens_per_step": b.processed_tokens_per_step, "padding_share": b.padding_share,
        "lengths": {"sampled": sampled is not None, "source": lengths.source if lengths is not None else None,
                    "counter": sampled.counter if sampled is not None else None,
                    "rows": len(sampled.rows) if sampled is not None else 0,
                    "mean_tokens_per_row": b.mean_row_tokens, "p95_tokens_per_row": b.p95_row_tokens},
    }


def _suggestion_json(s: Suggestion) -> dict:
    return {"changes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.changes.items()},
            "description": s.description, "changes_training": s.changes_training, **_estimate_json(s.estimate)}


def _estimate_json(estimate: Estimate) -> dict:
    m, t = estimate.memory, estimate.time
    gpu_peak, gpu_phase = m.peak("gpu")
    host_peak, host_phase = m.peak("host")
    return {
        "fits": m.fits,
        "gpu": {"peak_bytes": gpu_peak if any(i.where == "gpu" for i in m.items) else None,
                "peak_phase": gpu_phase, "capacity_bytes": m.gpu_capacity, "headroom_bytes": m.gpu_headroom},
        "host": {"peak_bytes": host_peak, "peak_phase": host_phase, "capacity_bytes": m.host_capacity,
                 "capacity_source": m.host_capacity_source, "headroom_bytes": m.host_headroom},
        "items": [{**asdict(i), "total_bytes": m.total_bytes(i)} for i in m.items],
        "batches": _batches_json(estimate.batches),
        "time": None if t is None else asdict(t),
    }


def plan_to_json(plans: list[StagePlan]) -> dict:
    """The same numbers as format_plan, machine-readable (bytes and seconds)."""
    stages = []
    for plan in plans:
        entry = {
            "stage": plan.stage, "kind": plan.kind, "model": plan.model,
            "shape": {k: v for k, v in asdict(plan.shape).items() if k != "source"} | {"n_params": plan.shape.n_params,
                                                                                        "source": plan.shape.source},
            "settings": asdict(plan.knobs),
            "gpu_name": plan.hardware.gpu.name if plan.hardware.gpu else None,  # "gpu": the memory, below
            "processes": plan.world, "data_parallel": plan.data_parallel, "trained_params": plan.trained_params,
            "total_params": plan.total_params,
            **_estimate_json(plan.estimate),
            "warnings": plan.warnings,
            "suggestions": [_suggestion_json(s) for s in plan.suggestions],
            "without": [_suggestion_json(s) for s in plan.without],
        }
        stages.append(entry)
    return {"fits": all(p.fits is not False for p in plans), "stages": stages}
