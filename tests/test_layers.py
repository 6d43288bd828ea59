"""The house's layers: core (torch-free base) <- stages (the nodes) <- pipeline (the orchestrator).

core imports neither pipeline nor stages; stages imports nothing from pipeline; pipeline reaches
stages only through the job entry points it hands to an executor (as an import, a `-m` module or
a `-c` program of a child process). No package-level cycle, lazy imports included: the checks
read every import statement in every function, not just the module's top.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "pipeline", "stages")
# What pipeline may reach in stages: the job and child-process entry points, each with why.
ENTRY_POINTS = {
    "stages.runner": "the stage job: StageJob (submitit) and run_stage (`python -m pipeline stage`)",
    "stages.calibrate": "calibrate's measuring job",
    "stages.supervise": "the local stage job's supervisor process (`-m`)",
    "stages.scale_model": "builds a scale model in a child process (`-m`): it needs transformers",
    "stages.data": "validate's token-length measurement in a child process (`-m`): it needs a tokenizer",
    "stages.distributed": "the local GPU check in a child process (`-c`): it needs torch",
}
LAYER = {"core": 0, "stages": 1, "pipeline": 2}
MODULE_STRING = re.compile(r"\b((?:core|pipeline|stages)(?:\.\w+)+)")


def imports(root: Path) -> list[tuple[str, str, int, str]]:
    """(importing module, imported module, line, how) for every import of a project package under
    `root`, anywhere in a file, and every module named in a string (`-m stages.x`, `-c "from ..."`)."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            tree = ast.parse(path.read_text(), str(path))
            docstrings = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                    found += [(module, t, node.lineno, "import") for t in targets[:1]]
                    found += [(module, t, node.lineno, "import") for t in targets[1:]
                              if (root / (t.replace(".", "/") + ".py")).is_file()]
                elif isinstance(node, ast.Import):
                    found += [(module, a.name, node.lineno, "import") for a in node.names]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    found += [(module, m, node.lineno, "string") for m in MODULE_STRING.findall(node.value)
                              if (root / (m.replace(".", "/") + ".py")).is_file()]
    return [f for f in found if f[1].split(".")[0] in PACKAGES]


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the module's, classes' and functions' docstrings: prose, not module references."""
    return {id(owner.body[0].value) for owner in ast.walk(tree)
            if isinstance(getattr(owner, "body", None), list) and owner.body
            and isinstance(owner.body[0], ast.Expr) and isinstance(owner.body[0].value, ast.Constant)}


def violations(root: Path) -> list[str]:
    """Every import that goes up a layer, other than pipeline's entry points into stages."""
    wrong = []
    for importer, imported, line, how in imports(root):
        src, dst = importer.split(".")[0], imported.split(".")[0]
        if src == "pipeline" and dst == "stages":
            if ".".join(imported.split(".")[:2]) in ENTRY_POINTS:
                continue
        elif LAYER[dst] <= LAYER[src]:
            continue
        wrong.append(f"{importer.replace('.', '/')}.py:{line} {how}s {imported}")
    return wrong


def package_cycles(root: Path) -> list[tuple[str, str]]:
    """Pairs of packages that import each other, entry points left out (they run in another process
    or are handed to an executor, never imported at pipeline's import time)."""
    edges = set()
    for importer, imported, _, how in imports(root):
        src, dst = importer.split(".")[0], imported.split(".")[0]
        if src != dst and not (how == "string" or ".".join(imported.split(".")[:2]) in ENTRY_POINTS):
            edges.add((src, dst))
    return sorted((a, b) for a, b in edges if (b, a) in edges and a < b)


def test_every_import_goes_down_a_layer():
    wrong = violations(REPO)
    assert not wrong, "imports against the layers (core <- stages <- pipeline):\n  " + "\n  ".join(wrong)


def test_no_package_imports_another_that_imports_it():
    assert package_cycles(REPO) == []


def test_the_checks_catch_a_planted_upward_import_and_cycle(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "core" / "config.py").write_text("def f():\n    from pipeline import graph\n")
    (tmp_path / "pipeline" / "graph.py").write_text("from core import config\n")
    (tmp_path / "pipeline" / "launch.py").write_text(
        "from stages.runner import StageJob\nfrom stages.engine import train\nCMD = '-m stages.data'\n")
    (tmp_path / "stages" / "runner.py").write_text("")
    (tmp_path / "stages" / "engine.py").write_text("from pipeline import graph\n")
    (tmp_path / "stages" / "data.py").write_text("")
    assert violations(tmp_path) == ["core/config.py:2 imports pipeline", "core/config.py:2 imports pipeline.graph",
                                    "pipeline/launch.py:2 imports stages.engine", "stages/engine.py:1 imports pipeline",
                                    "stages/engine.py:1 imports pipeline.graph"]
    assert package_cycles(tmp_path) == [("core", "pipeline"), ("pipeline", "stages")]


def test_core_and_pipeline_import_without_torch():
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
               for package in ("core", "pipeline") for p in sorted((REPO / package).rglob("*.py"))
               if p.name != "__main__.py"]
    program = ("import importlib, sys\n"
               f"for m in {modules!r}: importlib.import_module(m)\n"
               "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
