"""The generated parts of README.md: the pipeline file reference, from the schema's own
field docs, and the measured columns of the shipped pipelines' table, from
docs/measured.json.

`make docs` rewrites both; tests/test_docs.py fails when they and their sources disagree.
`python -m pipeline.docs --measured CONFIG` records a finished run of a shipped pipeline
(its stages' result.json, under the folder you run it in) into docs/measured.json first.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from core import config as c
from core import kinds
from core.cluster_spec import ApptainerSpec, ClusterSpec
from core.schemas.reward import RewardRule, RewardSpec

START, END = "<!-- reference:start -->", "<!-- reference:end -->"
PIPELINES_START, PIPELINES_END = "<!-- pipelines:start -->", "<!-- pipelines:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"
MEASURED = README.parent / "docs" / "measured.json"
# The table's own columns (written by hand), then the measured ones (generated).
PIPELINE_COLUMNS = ("file", "hardware", "stages", "the plan says")
MEASURED_COLUMNS = ("measured on", "time", "peak memory", "result")


def _default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None or field.default is None:
        return "—"
    value = list(field.default) if isinstance(field.default, tuple) else field.default
    return f"`{value}`"


def _table(title: str, model, prefix: str = "", skip=()) -> str:
    lines = [f"#### {title}", "", "| field | default | meaning |", "|---|---|---|"]
    for name, field in model.model_fields.items():
        if name not in skip:
            lines.append(f"| `{prefix}{field.alias or name}` | {_default(field)} | {field.description} |")
    return "\n".join(lines)


def reference_markdown() -> str:
    knobs = set(c.TrainingKnobs.model_fields)
    common = set(c.StageBase.model_fields) | {"kind"}
    sections = [
        _table("Top level", c.PipelineSpec),
        _table("`cluster:`", ClusterSpec, "cluster."),
    ]
    if hasattr(c, "ApptainerSpec"):
        sections.append(_table("`apptainer:`", ApptainerSpec, "apptainer."))
    sections.append(_table("`tracking.wandb:`", c.WandbSpec, "tracking.wandb."))
    sections += [
        _table("Every stage", c.StageBase, skip=knobs),
        _table("`data:`", c.DataSpec, "data."),
        _table("Training knobs (in a stage, or under `defaults:` for all stages)", c.TrainingKnobs),
        _table("`lora:`", c.LoraSpec, "lora."),
    ]
    for kind in kinds.all_kinds():
        extra = [n for n in kind.schema.model_fields if n not in common]
        if extra:
            sections.append(_table(f"`kind: {kind.name}`", kind.schema, skip=common))
    sections += [
        _table("`reward:` (kind: ppo)", RewardSpec, "reward."),
        _table("`reward.rules:` (each term)", RewardRule),
    ]
    return "\n\n".join(sections)


def pipelines_table(current: str, measured: dict) -> str:
    """The shipped pipelines' table: each row's first columns as they are, the measured
    columns from `measured` (keyed by file name; a pipeline never run shows "not run")."""
    lines = ["| " + " | ".join(PIPELINE_COLUMNS + MEASURED_COLUMNS) + " |",
             "|" + "---|" * (len(PIPELINE_COLUMNS) + len(MEASURED_COLUMNS))]
    for line in current.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")][: len(PIPELINE_COLUMNS)]
        named = re.search(r"`([^`]+)`", cells[0])  # e.g. `a.yaml` (also `b.yaml`)
        run = measured.get(named.group(1) if named else cells[0])
        if run is None:
            extra = ["not run", "", "", ""]
        else:
            extra = [f"{run['hardware']}, {run['date']}", _minutes(run["seconds"]), run["peak_memory"] or "",
                     run["result"]]
        lines.append("| " + " | ".join(cells + extra) + " |")
    return "\n".join(lines)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def load_measured(path: Path = MEASURED) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def record_run(config: str, path: Path = MEASURED) -> dict:
    """Add a finished run of a shipped pipeline (under the current folder's runs_dir) to docs/measured.json."""
    from core import measured
    from core.errors import InvalidInput
    from pipeline import graph

    file = c.resolve_config_path(config)
    summary = measured.run_summary(graph.build_tasks(c.load_pipeline(config)))
    if summary is None:
        raise InvalidInput(f"{config}: not every stage has finished; run it first (`python -m pipeline run {config}`)")
    runs = load_measured(path)
    runs[file.name] = summary
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(runs.items())), indent=2) + "\n")
    return summary


def _between(text: str, start: str, end: str) -> tuple[str, str, str]:
    head, rest = text.split(start, 1)
    middle, tail = rest.split(end, 1)
    return head, middle, tail


def rewrite_readme(path: Path = README, measured_path: Path = MEASURED) -> None:
    head, _, tail = _between(path.read_text(), START, END)
    text = f"{head}{START}\n{reference_markdown()}\n{END}{tail}"
    head, table, tail = _between(text, PIPELINES_START, PIPELINES_END)
    path.write_text(f"{head}{PIPELINES_START}\n{pipelines_table(table, load_measured(measured_path))}\n"
                    f"{PIPELINES_END}{tail}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pipeline.docs", description="rewrite README.md's generated parts")
    parser.add_argument("readme", nargs="?", default=str(README))
    parser.add_argument("--measured", metavar="CONFIG", help="first record the finished run of this shipped pipeline")
    args = parser.parse_args()
    if args.measured:
        record_run(args.measured)
    rewrite_readme(Path(args.readme))
