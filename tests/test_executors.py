"""The executor seam (pipeline/executors/): only the schedulers' packages (schedulers/) and
the schema know the executors by name; everything else asks the executor it is given.

The scan reads every module of the project's packages for a string that is an executor's
name ("local", "slurm") and for a comparison with an `executor` attribute
(`spec.cluster.executor == ...`): either is code asking which executor it is.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import schedulers
from core import cluster_spec
from pipeline import executors
from tests.conftest import PACKAGES, REPO, copy_of_the_code

# The cluster section's schema (cluster.executor's default and documentation: core/cluster_spec.py)
# and the schedulers' packages: the only places that may name one.
SCHEMA = Path(cluster_spec.__file__).resolve().relative_to(REPO).as_posix()
EXECUTOR_MODULES = Path(schedulers.__file__).resolve().parent.relative_to(REPO).as_posix() + "/"
NAMES = schedulers.names()


def executor_questions(root: Path) -> list[str]:
    """`path:line: what` for each executor name in a string and each comparison with an
    `executor` attribute, in the modules of the packages under root (PACKAGES) but the schema and
    the executor modules."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative == SCHEMA or relative.startswith(EXECUTOR_MODULES):
                continue
            source = path.read_text()
            for token in tokenize.generate_tokens(io.StringIO(source).readline):
                if token.type == tokenize.STRING and _string_value(token.string) in NAMES:
                    found.append(f"{relative}:{token.start[0]}: the string {token.string}")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Compare) and any(
                        isinstance(side, ast.Attribute) and side.attr == "executor"
                        for side in [node.left, *node.comparators]):
                    found.append(f"{relative}:{node.lineno}: a comparison with .executor")
    return found


def _string_value(literal: str):
    try:
        return ast.literal_eval(literal)
    except (ValueError, SyntaxError):  # an f-string: its pieces are not a name on their own
        return None


def test_only_the_executor_modules_and_the_schema_name_an_executor():
    assert {"pipeline", "schedulers", "stages"} <= set(PACKAGES)
    found = executor_questions(REPO)
    assert not found, ("code outside schedulers/ and the schema asks which executor it is; ask the "
                       "executor (pipeline/executors/base.py) instead:\n  " + "\n  ".join(found))


def test_the_scan_finds_a_planted_question(tmp_path):
    copy_of_the_code(tmp_path)
    assert executor_questions(tmp_path) == []
    planted = tmp_path / "pipeline" / "launch.py"
    planted.write_text(planted.read_text() + "\n\ndef planted(spec):\n"
                       "    return spec.cluster.executor == 'slurm'\n")
    lines = len(planted.read_text().splitlines())
    assert executor_questions(tmp_path) == [f"pipeline/launch.py:{lines}: the string 'slurm'",
                                            f"pipeline/launch.py:{lines}: a comparison with .executor"]


def test_every_scheduler_has_one_executor_of_its_name():
    assert NAMES[:2] == ["local", "slurm"]  # the shipped ones, found in schedulers/
    found = executors.executors()
    assert list(found) == NAMES
    for name in NAMES:
        assert executors.executor_for(name).name == name
    doings = [cls.doing for cls in found.values()]
    assert len(set(doings)) == len(doings)  # `cancel` finds the executor of the `run` holding a folder by it
