"""max_len against each stage's rows, before anything runs: `validate`, `run` and
`prepare` refuse (exit 2) a stage whose max_len would cut more than
max_truncated_share of its rows, with the numbers, and note the stages where it
cuts fewer.

The numbers are the stage's own: stages/data.py's tokenized_splits, with the
tokenizer loaded as the stage loads it, run in a subprocess of this python
because it imports transformers and torch, which pipeline/ never does. A stage
is measured when its tokenizer and rows are on this machine: its model, or the
model its `from` chain starts at (upstream stages export that model's
tokenizer), is built-in, a local folder or in the Hugging Face cache, and its
data is a local file or a local dataset folder. Other stages, and the built-in
task's (rows of a few characters), measure it themselves when they start. Data of
more than SAMPLE_ROWS rows is measured on a random sample of that many (the
message says so): tokenising every row of a large file takes minutes (README.md,
Data).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from core.config import BUILTIN_PREFIX, PipelineSpec
from core.errors import InvalidInput
from pipeline.hfcache import HFCache

SAMPLE_ROWS = 1000  # as many as the plan samples for lengths (pipeline/lengths.py)
TIMEOUT_S = 300
REPO = Path(__file__).resolve().parent.parent


def check(spec: PipelineSpec, cache: HFCache) -> None:
    """Refuse (InvalidInput) the first measurable stage that max_len cuts too much; print a
    note for each that it cuts at all."""
    from pipeline.preflight import model_folder, root_model  # preflight calls this module

    jobs = []
    for i, stage in enumerate(spec.stages):
        root = root_model(spec, stage)
        tokenizer = root if root.startswith(BUILTIN_PREFIX) else model_folder(root, cache)
        # The built-in task's rows are a few characters long: the stage still measures them, but
        # preflight does not start a subprocess (torch and transformers imports, ~4 s) for them.
        if tokenizer is not None and not stage.data.is_builtin and Path(stage.data.path).exists():
            jobs.append({"where": f"stages[{i}] ({stage.name})", "model": str(tokenizer),
                         "stage": stage.model_dump(mode="json", by_alias=True),
                         "declared_in": type(stage).__module__})  # a plug-in kind registers when imported
    if not jobs:
        return
    env = {**os.environ, **cache.env(), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    request = json.dumps({"sample": SAMPLE_ROWS, "stages": jobs})
    try:
        done = subprocess.run([sys.executable, "-m", "stages.measure_truncation"], input=request,
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return _not_measured(f"it took longer than {TIMEOUT_S} s")
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return _not_measured(last)
    if "error" in answer:
        raise InvalidInput(answer["error"])
    for report in answer["stages"]:
        if report["affected"]:
            print(f"note: {report['where']}: {report['summary']}")


def _not_measured(why: str) -> None:
    print(f"note: max_len was not measured against the data here ({why}); each stage measures it when it starts",
          file=sys.stderr)
