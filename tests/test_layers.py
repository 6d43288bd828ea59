"""The house's layers: schedulers' node halves <- core (torch-free base) <- stages (the nodes)
<- pipeline (the orchestrator) <- schedulers' executors.

A scheduler is one package under schedulers/ with two halves. Its declaration (__init__.py)
and node half (node.py), and the registry around them, import nothing of the project: core
asks them who a process is. Every other module of a scheduler's package is its executor, the
submit half, standing on top of pipeline; pipeline reaches it only by name, through the
declaration. core imports neither pipeline nor stages; stages imports nothing from pipeline;
pipeline and the executors reach stages only through the job entry points they hand to a
scheduler (as an import, a `-m` module or a `-c` program of a child process). No cycle
between layers, lazy imports included: the checks read every import statement in every
function, not just the module's top.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "pipeline", "schedulers", "stages")
# What pipeline (and the executors) may reach in stages: the job and child-process entry points, each with why.
ENTRY_POINTS = {
    "stages.runner": "the stage job: StageJob and run_stage (`python -m pipeline run-stage`)",
    "stages.calibrate": "calibrate's measuring job",
    "stages.supervise": "the local stage job's supervisor process (`-m`)",
    "stages.scale_model": "builds a scale model in a child process (`-m`): it needs transformers",
    "stages.measure_truncation": "validate's token-length measurement in a child process (`-m`): it needs a tokenizer",
    "stages.distributed": "the local GPU check in a child process (`-c`): it needs torch",
}
EXECUTORS = "schedulers' executors"  # the submit halves: a layer of their own
LAYER = {"schedulers": 0, "core": 1, "stages": 2, "pipeline": 3, EXECUTORS: 4}
MODULE_STRING = re.compile(r"\b((?:core|pipeline|schedulers|stages)(?:\.\w+)+)")


def layer_of(module: str) -> str:
    """The layer a module is in: its package's, but a scheduler's modules other than its
    declaration and node.py are its executor."""
    parts = module.split(".")
    if parts[0] == "schedulers" and len(parts) > 2 and parts[2] != "node":
        return EXECUTORS
    return parts[0]


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
    """Every import that goes up a layer, other than the orchestrator's entry points into stages
    and a scheduler's declaration naming its own executor."""
    wrong = []
    for importer, imported, line, how in imports(root):
        src, dst = layer_of(importer), layer_of(imported)
        if src in ("pipeline", EXECUTORS) and dst == "stages":
            if ".".join(imported.split(".")[:2]) in ENTRY_POINTS:
                continue
        elif LAYER[dst] <= LAYER[src] or (how == "string" and _declares(importer, imported)):
            continue
        wrong.append(f"{importer.replace('.', '/')}.py:{line} {how}s {imported}")
    return wrong


def _declares(declaration: str, executor: str) -> bool:
    """`declaration` is a scheduler's package and `executor` a module of it."""
    return declaration.count(".") == 1 and executor.startswith(declaration + ".")


def package_cycles(root: Path) -> list[tuple[str, str]]:
    """Pairs of layers that import each other, entry points left out (they run in another process
    or are handed to a scheduler, never imported at pipeline's import time)."""
    edges = set()
    for importer, imported, _, how in imports(root):
        src, dst = layer_of(importer), layer_of(imported)
        if src != dst and not (how == "string" or ".".join(imported.split(".")[:2]) in ENTRY_POINTS):
            edges.add((src, dst))
    return sorted((a, b) for a, b in edges if (b, a) in edges and a < b)


def test_every_import_goes_down_a_layer():
    wrong = violations(REPO)
    assert not wrong, ("imports against the layers (schedulers' node halves <- core <- stages <- pipeline <- "
                       "schedulers' executors):\n  " + "\n  ".join(wrong))


def test_no_package_imports_another_that_imports_it():
    assert package_cycles(REPO) == []


def test_the_checks_catch_a_planted_upward_import_and_cycle(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "core" / "config.py").write_text("def f():\n    from pipeline import graph\n")
    (tmp_path / "pipeline" / "graph.py").write_text("from core import config\n")
    (tmp_path / "pipeline" / "launch.py").write_text(
        "from stages.runner import StageJob\nfrom stages.engine import train\nCMD = '-m stages.measure_truncation'\n")
    (tmp_path / "stages" / "runner.py").write_text("")
    (tmp_path / "stages" / "engine.py").write_text("from pipeline import graph\n")
    (tmp_path / "stages" / "measure_truncation.py").write_text("")
    assert violations(tmp_path) == ["core/config.py:2 imports pipeline", "core/config.py:2 imports pipeline.graph",
                                    "pipeline/launch.py:2 imports stages.engine", "stages/engine.py:1 imports pipeline",
                                    "stages/engine.py:1 imports pipeline.graph"]
    assert package_cycles(tmp_path) == [("core", "pipeline"), ("pipeline", "stages")]


def test_the_checks_keep_a_schedulers_halves_in_their_layers(tmp_path):
    for package in (*PACKAGES, "schedulers/x"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "core" / "failure.py").write_text("import schedulers\nfrom schedulers.x import node\n")
    (tmp_path / "schedulers" / "x" / "__init__.py").write_text("EXECUTOR = 'schedulers.x.submit:XExecutor'\n")
    (tmp_path / "schedulers" / "x" / "node.py").write_text("from core import failure\n")
    (tmp_path / "schedulers" / "x" / "submit.py").write_text(
        "from pipeline import launch\nfrom stages.runner import StageJob\nfrom stages import engine\n")
    (tmp_path / "pipeline" / "launch.py").write_text("from schedulers.x import submit\n")
    for module in ("runner", "engine"):
        (tmp_path / "stages" / f"{module}.py").write_text("")
    assert violations(tmp_path) == [
        "pipeline/launch.py:1 imports schedulers.x.submit",
        "schedulers/x/node.py:1 imports core", "schedulers/x/node.py:1 imports core.failure",
        "schedulers/x/submit.py:3 imports stages", "schedulers/x/submit.py:3 imports stages.engine"]
    assert package_cycles(tmp_path) == [("core", "schedulers"), ("pipeline", EXECUTORS)]


def test_core_pipeline_and_the_schedulers_import_without_torch():
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
               for package in ("core", "pipeline", "schedulers") for p in sorted((REPO / package).rglob("*.py"))
               if p.name != "__main__.py"]
    program = ("import importlib, sys\n"
               f"for m in {modules!r}: importlib.import_module(m)\n"
               "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
