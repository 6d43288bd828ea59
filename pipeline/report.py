"""`python -m pipeline report CONFIG`: runs/<pipeline>/report.html, one self-contained page
(PNG plots embedded as base64, no script, no server) about the whole chain: its timeline,
each stage's final metrics, plan versus measured, and per stage the training and eval
curves, throughput and memory over time. Works on a chain that is still running: it shows
what the folders hold so far.

Reads the run folder (metrics.jsonl, result.json, plan.json, events.jsonl) and
pipeline.json; each stage's state is the one `status` shows (pipeline/executors/:
the same call), so the two never disagree. Plots with matplotlib's Agg backend (no
display needed).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import os
import re
import time
from pathlib import Path

from core import measured, runfolder, timeline
from core import metrics as records
from core.task import is_finished
from pipeline import executors, graph, state

COLORS = {timeline.QUEUED: "#c7c7c7", timeline.STARTING: "#9ecae1", timeline.RUNNING: "#4c72b0",
          timeline.REQUEUED: "#dd8452"}
COMPARED_LABELS = {
    "gpu_mem_peak_gib": "GPU memory peak per process (GiB)",
    "host_mem_gib": "host memory per node (GiB)",
    "step_s": "seconds per {unit}",
    "tokens_per_s": "tokens/s",
    "mfu": "MFU",
    "token_efficiency": "real / processed tokens",
}


def write_report(spec, plots_dir: Path | None = None) -> Path:
    """Write the report of a pipeline's run folder; returns its path. With `plots_dir`, each
    plot is also saved there as <pipeline>-<plot>.png (e.g. for a README)."""
    pipeline_dir = spec.run_dir.resolve()
    tasks = graph.build_tasks(spec)
    run_state = state.load(pipeline_dir)
    page = render(spec.name, tasks, run_state,
                  executors.stage_statuses(tasks, run_state, state.holder(pipeline_dir)))
    path = runfolder.report_file(pipeline_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(page)
    os.replace(tmp, path)
    if plots_dir is not None:
        save_plots(page, spec.name, Path(plots_dir))
    return path


def save_plots(page: str, name: str, folder: Path) -> list[Path]:
    """The page's embedded PNGs as files, named after their alt text."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = []
    for alt, data in re.findall(r"<img alt='([^']*)' src='data:image/png;base64,([^']+)'>", page):
        path = folder / f"{name}-{re.sub(r'[^A-Za-z0-9]+', '-', html.unescape(alt)).strip('-')}.png"
        path.write_bytes(base64.b64decode(data))
        saved.append(path)
    return saved


def render(name: str, tasks: list, run_state: state.RunState | None,
           statuses: list[state.StageStatus] | None = None) -> str:
    """The page; `statuses`: each stage's as `status` has it (default: from pipeline.json and
    the folders, with no `run` holding them)."""
    import matplotlib

    matplotlib.use("Agg")
    submitted = {n: r.submitted_at for n, r in run_state.stages.items()} if run_state else {}
    statuses = statuses if statuses is not None else executors.stage_statuses(tasks, run_state)
    stages = [_StageData(task, submitted.get(task.name), status) for task, status in zip(tasks, statuses)]
    parts = [f"<h1>pipeline {_e(name)}</h1>",
             f"<p>Run folder {_e(tasks[0].pipeline_dir)} &middot; report written {time.strftime('%Y-%m-%d %H:%M:%S')}"
             f"{'' if all(s.finished for s in stages) else ' &middot; <b>partial</b>: stages still to finish'}</p>",
             "<h2>Timeline</h2>", _timeline_figure(stages),
             "<h2>Final metrics</h2>", _final_table(stages),
             "<h2>Plan versus measured</h2>", _plan_table(stages), _plan_figure(stages)]
    for stage in stages:
        parts.append(f"<h2 id='{_e(stage.name)}'>Stage {_e(stage.name)} ({_e(stage.kind)})</h2>")
        if not stage.records:
            parts.append("<p>No metrics yet.</p>")
            continue
        for title, figure in stage.figures():
            parts.append(f"<h3>{_e(title)}</h3>{figure}")
    return _PAGE.format(title=_e(f"pipeline {name}"), body="\n".join(parts))


class _StageData:
    """What one stage's folder holds."""

    def __init__(self, task, submitted_at: str | None, status: state.StageStatus):
        self.task, self.name, self.kind, self.status = task, task.name, task.stage.kind, status
        folder = task.folder
        self.records = records.read(folder.metrics)
        self.training = records.training(self.records)
        self.evals = records.evaluations(self.records)
        self.result = measured.read_json(folder.result) if is_finished(task) else None
        self.finished = self.result is not None
        self.plan = measured.read_json(folder.plan)
        self.timeline = timeline.stage_timeline(folder, submitted_at)
        self.progress = records.progress(folder.metrics)

    @property
    def state(self) -> str:
        """`status`'s state and why; the step reached, with an ETA only while it runs."""
        said = self.status.state
        if self.status.state == state.FINISHED:
            return said
        if self.progress is not None:
            if self.status.state == state.RUNNING:
                return f"{said}, {self.progress.text()}"
            said += f", {dataclasses.replace(self.progress, eta_s=None, time=None).text()}"  # where it stopped
        return f"{said}: {self.status.detail}" if self.status.detail else said

    def comparison(self) -> dict:
        if self.result is not None and "measured" in self.result:
            return {"measured": self.result["measured"], "planned": self.result.get("planned")}
        return measured.plan_vs_measured(self.task.folder, self.kind)  # a running stage: so far

    def figures(self) -> list[tuple[str, str]]:
        """(title, HTML) of each plot, and under it in one line what was left out and why: a
        series that is 0 throughout, or one not measured (the GPU's busy share on a CPU)."""
        out = []
        train = _series(self.training, "train/")
        if train:
            out.append(("Training curves (by optimizer step)", _grid(train, "step", f"{self.name} training")))
        evals = _series(self.evals, "eval/")
        if evals:
            out.append(("Evaluation (by optimizer step)", _grid(evals, "step", f"{self.name} eval", marker="o")))
        rollouts = [r for r in self.training if "rollout_s" in r]
        if rollouts:
            out.append(("Where each rollout's time goes (phases add up to the rollout; the GPU's busy share in each)",
                        _phases_figure(rollouts, f"{self.name} rollout phases")))
        times = [r["time"] for r in self.records if "time" in r]
        unit, seconds = _time_unit(max(times) - min(times) if times else 0.0)
        clock = (min(times), seconds) if times else None
        perf = _series(self.training, "perf/", "time/", clock=clock)
        if perf:
            out.append((f"Throughput and where the time goes (by {unit} since the first record)",
                        _grid(perf, unit, f"{self.name} throughput")))
        memory = _series(self.training, "memory/", clock=clock)
        if memory:
            out.append((f"Memory (by {unit} since the first record)",
                        _grid(memory, unit, f"{self.name} memory", together=True)))
        return out


def _series(rows: list[dict], *prefixes: str, clock: tuple | None = None) -> dict[str, tuple[list, list]]:
    """{tag: (x, y)} of the record keys whose TensorBoard tag starts with one of `prefixes`;
    x is the step, or with `clock` (start, seconds per unit) the time since start in that unit."""
    out: dict[str, tuple[list, list]] = {}
    for row in rows:
        x = row["step"] if clock is None else (row.get("time", clock[0]) - clock[0]) / clock[1]
        for name, value in records.scalars(row).items():
            if name.startswith(prefixes):
                xs, ys = out.setdefault(name, ([], []))
                xs.append(x)
                ys.append(value)
    return out


def _time_unit(span_s: float) -> tuple[str, float]:
    """The unit a time axis of `span_s` seconds reads best in: its ticks stay short numbers."""
    if span_s < 180:
        return "seconds", 1.0
    return ("minutes", 60.0) if span_s < 3 * 3600 else ("hours", 3600.0)


def _grid(series: dict, xlabel: str, alt: str, marker: str | None = None, together: bool = False) -> str:
    """Small multiples, four to a row (or all lines in one plot). A series that is 0 throughout
    is not drawn (a flat line at 0 says nothing): one line under the plot names it."""
    import matplotlib.pyplot as plt

    zero = [name for name, (_, ys) in series.items() if not any(ys)]
    series = {name: xy for name, xy in series.items() if name not in zero}
    said = f"<p class='note'>0 throughout, so not plotted: {_e(', '.join(zero))}</p>" if zero else ""
    if not series:
        return said
    names = list(series)
    panels = [names] if together else [[n] for n in names]
    columns = min(4, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 2.5 * rows), squeeze=False)
    # Fixed margins: tight_layout would measure every tick label again (most of the report's time).
    fig.subplots_adjust(left=0.6 / (3.4 * columns), right=1 - 0.15 / (3.4 * columns), bottom=0.5 / (2.5 * rows),
                        top=1 - 0.3 / (2.5 * rows), wspace=0.35, hspace=0.55)
    for ax, panel in zip(axes.flat, panels):
        for name in panel:
            xs, ys = series[name]
            ax.plot(xs, ys, marker=marker or ("." if len(xs) < 30 else None), label=name.split("/", 1)[1])
        ax.set_title(panel[0] if not together else ", ".join(n.split("/", 1)[1] for n in panel), fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        _readable_ticks(ax)
        ax.grid(alpha=0.3)
        if together:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    return _embed(fig, alt) + said


def _readable_ticks(ax) -> None:
    """At most six ticks a side, small: a panel is 3.4 inches wide, and left to itself matplotlib
    puts ten labels such as 0.0035 under it, which run into each other."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.tick_params(labelsize=7)


PHASE_COLORS = {"generate_s": "#4c72b0", "score_s": "#dd8452", "train_s": "#55a868", "sync_s": "#8172b3",
                "other_s": "#c7c7c7"}


def _phases_figure(rollouts: list[dict], alt: str) -> str:
    """Per rollout, its phases stacked (core/metrics.py ROLLOUT_PHASES; the parts inside a phase,
    ZeRO-3 gathering and offload moves, hatched at its base) against its wall time; beside it the
    GPU's busy share per phase, or under it one line saying it was not measured."""
    import matplotlib.pyplot as plt

    xs = [r.get("rollout", r["step"]) for r in rollouts]
    measured = [k for k in records.GPU_BUSY_KEYS if any(r.get(k) is not None for r in rollouts)]
    if measured:
        fig, (ax, busy_ax) = plt.subplots(1, 2, figsize=(11, 3.0), gridspec_kw={"width_ratios": [3, 2]})
        fig.subplots_adjust(left=0.06, right=0.98, bottom=0.17, top=0.8, wspace=0.25)
    else:
        fig, ax = plt.subplots(figsize=(6.6, 3.0))
        fig.subplots_adjust(left=0.1, right=0.97, bottom=0.17, top=0.8)
    base = [0.0] * len(rollouts)
    parts_in = {phase: part for part, phase in records.ROLLOUT_PHASE_PARTS.items()}
    for phase in records.ROLLOUT_PHASES:
        heights = [r.get(phase) or 0.0 for r in rollouts]
        ax.bar(xs, heights, bottom=base, color=PHASE_COLORS[phase], label=phase[:-2])
        part = parts_in.get(phase)
        if part is not None and any(r.get(part) for r in rollouts):
            ax.bar(xs, [r.get(part) or 0.0 for r in rollouts], bottom=base, color="none", edgecolor="#222",
                   hatch="//", linewidth=0, label=f"{part[:-2]} (in {phase[:-2]})")
        base = [b + h for b, h in zip(base, heights)]
    ax.plot(xs, [r["rollout_s"] for r in rollouts], "k_", markersize=12, label="rollout wall time")
    ax.set_xlabel("rollout", fontsize=8)
    ax.set_ylabel("seconds", fontsize=8)
    _readable_ticks(ax)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=4, loc="lower left", bbox_to_anchor=(0, 1.01), frameon=False)
    if not measured:
        return _embed(fig, alt) + ("<p class='note'>GPU busy share: not measured (no GPU, or NVML could not be "
                                   "read)</p>")
    for key in measured:
        busy_ax.plot(xs, [r.get(key) for r in rollouts], marker=".", label=key[len("gpu_busy_"):])
    busy_ax.set_ylim(0, 1.05)
    busy_ax.legend(fontsize=7)
    busy_ax.set_title("GPU busy share (NVML utilisation)", fontsize=9)
    busy_ax.set_xlabel("rollout", fontsize=8)
    _readable_ticks(busy_ax)
    busy_ax.grid(alpha=0.3)
    return _embed(fig, alt)


def _timeline_figure(stages: list[_StageData]) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.artist import Artist
    from matplotlib.patches import Patch

    rows = [s for s in stages if s.timeline.segments]
    if not rows:
        return "<p>No stage has started yet.</p>"
    origin = min(seg.start for s in rows for seg in s.timeline.segments)
    height = 0.55 * len(rows) + 1.2
    fig, ax = plt.subplots(figsize=(11, height))
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.55 / height, top=1 - 0.35 / height)
    for y, stage in enumerate(reversed(rows)):
        for seg in stage.timeline.segments:
            ax.barh(y, max(seg.end - seg.start, 0.5) / 60, left=(seg.start - origin) / 60, height=0.5,
                    color=COLORS[seg.state])
        if stage.timeline.done is not None:
            ax.plot((stage.timeline.done - origin) / 60, y, marker="D", color="#55a868")
    ax.set_yticks(range(len(rows)), [s.name for s in reversed(rows)])
    ax.set_xlabel("minutes since the first submission")
    ax.grid(axis="x", alpha=0.3)
    handles: list[Artist] = [Patch(color=c, label=s) for s, c in COLORS.items()]
    handles.append(plt.Line2D([], [], marker="D", color="#55a868", linestyle="", label=timeline.DONE))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.01), fontsize=8, ncol=5, frameon=False)
    return _embed(fig, "timeline")


def _final_table(stages: list[_StageData]) -> str:
    head = "<tr><th>stage</th><th>kind</th><th>state</th><th>seconds</th><th>result</th></tr>"
    body = []
    for s in stages:
        numbers = {k: v for k, v in (s.result or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("seconds", "world_size")}
        shown = ", ".join(f"{_e(k)}&nbsp;=&nbsp;{records.number_text(v)}" for k, v in numbers.items()) or "&mdash;"
        seconds = s.result.get("seconds", "") if s.result else ""
        body.append(f"<tr><td>{_e(s.name)}</td><td>{_e(s.kind)}</td><td>{_e(s.state)}</td><td>{seconds}</td>"
                    f"<td>{shown}</td></tr>")
    return f"<table>{head}{''.join(body)}</table>"


def _plan_table(stages: list[_StageData]) -> str:
    head = "<tr><th>stage</th><th>quantity</th><th>planned</th><th>measured</th><th>measured / planned</th></tr>"
    body = []
    for s in stages:
        if not s.training and s.plan is None:
            continue
        both = s.comparison()
        planned, got = both.get("planned") or {}, both["measured"]
        unit = got.get("unit", "step")
        for key in measured.COMPARED:
            label = COMPARED_LABELS[key]
            p, m = planned.get(key), got.get(key)
            if p is None and m is None:
                continue
            ratio = f"{m / p:.2f}" if p and m is not None else "&mdash;"
            body.append(f"<tr><td>{_e(s.name)}</td><td>{_e(label.format(unit=unit))}</td>"
                        f"<td>{_num(p)}</td><td>{_num(m)}</td><td>{ratio}</td></tr>")
    if not body:
        return "<p>Nothing planned or measured yet.</p>"
    note = ("<p class='note'>Planned: the stage's plan.json, saved when it was submitted (time needs a known GPU). "
            "Measured: result.json, or metrics.jsonl so far; memory is the largest record, rates the mean of the "
            "records after the first.</p>")
    return f"<table>{head}{''.join(body)}</table>{note}"


def _plan_figure(stages: list[_StageData]) -> str:
    """One bar pair (planned, measured) per stage for each quantity that has both somewhere."""
    import matplotlib.pyplot as plt

    pairs = {s.name: s.comparison() for s in stages if s.training or s.plan is not None}
    keys = [k for k in measured.COMPARED
            if any((c.get("planned") or {}).get(k) is not None and c["measured"].get(k) is not None
                   for c in pairs.values())]
    if not keys:
        return ""
    fig, axes = plt.subplots(1, len(keys), figsize=(3.4 * len(keys), 2.8), squeeze=False)
    fig.subplots_adjust(left=0.6 / (3.4 * len(keys)), right=0.98, bottom=0.15, top=0.88, wspace=0.35)
    names = list(pairs)
    for ax, key in zip(axes.flat, keys):
        planned = [(pairs[n].get("planned") or {}).get(key) or 0.0 for n in names]
        got = [pairs[n]["measured"].get(key) or 0.0 for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], planned, width=0.4, label="planned", color="#8c8c8c")
        ax.bar([x + 0.2 for x in xs], got, width=0.4, label="measured", color="#4c72b0")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_title(COMPARED_LABELS[key].format(unit="step"), fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    return _embed(fig, "plan vs measured")


def _num(value) -> str:
    return "&mdash;" if value is None else records.number_text(float(value))


def _embed(fig, alt: str) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"<img alt='{_e(alt)}' src='data:image/png;base64,{data}'>"


def _e(text) -> str:
    return html.escape(str(text), quote=True)


_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; max-width: 1500px; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }}
th {{ background: #f0f0f0; }}
img {{ max-width: 100%; }}
.note {{ color: #666; font-size: 0.85em; }}
</style></head>
<body>
{body}
</body></html>
"""
