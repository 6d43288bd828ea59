"""Validate's measurement of what max_len cuts, with the stages' own tokenisation (stages/data.py),
in a process of its own: `python -m stages.measure_truncation < REQUEST` (pipeline/truncation.py
sends the request and reads the answer)."""

from __future__ import annotations

from pathlib import Path

from core import tiny
from core.config import BUILTIN_PREFIX
from core.errors import InvalidInput
from stages.data import tokenized_splits


def main() -> int:
    """python -m stages.measure_truncation < REQUEST: pipeline/truncation.py's measurement, in a process of
    its own because it imports transformers (and torch). REQUEST is JSON: {"sample": N,
    "stages": [{"where": ..., "stage": the Stage as JSON, "declared_in": the module of its kind's
    schema, imported first (a plug-in kind registers itself), "model": the model whose tokenizer
    the stage starts with}]}. Prints one JSON line last: {"stages": [{"where", "summary",
    "affected"}]}, or {"error": the message} with exit 2 when a stage is refused. Writes
    nothing but a temporary folder (the built-ins, when named)."""
    import importlib
    import json
    import sys
    import tempfile

    from pydantic import TypeAdapter

    from core.config import Stage
    from stages import models

    request = json.load(sys.stdin)
    reports = []
    with tempfile.TemporaryDirectory(prefix="truncation-") as scratch:
        tokenizers: dict = {}
        try:
            for job in request["stages"]:
                importlib.import_module(job.get("declared_in", "core.config"))
                stage = TypeAdapter(Stage).validate_python(job["stage"])
                if job["model"] not in tokenizers:
                    tokenizers[job["model"]] = models.load_tokenizer(_tokenizer_folder(job["model"], Path(scratch)))
                splits = tokenized_splits(stage, tokenizers[job["model"]], Path(scratch), job["where"],
                                          request["sample"])
                affected = splits.train.truncation.affected + splits.eval.truncation.affected
                reports.append({"where": job["where"], "summary": splits.summary(stage.kind), "affected": affected})
        except InvalidInput as err:
            print(json.dumps({"error": err.message}))
            return 2
    print(json.dumps({"stages": reports}))
    return 0


def _tokenizer_folder(model: str, scratch: Path) -> str:
    """Where the model's tokenizer is: the built-in tiny-llama's written alone, as
    tiny.materialize writes it beside the model (building the model would take seconds)."""
    if model == BUILTIN_PREFIX + "tiny-llama":
        tiny.build_tokenizer().save_pretrained(scratch / "tokenizer")
        return str(scratch / "tokenizer")
    return model


if __name__ == "__main__":
    raise SystemExit(main())
