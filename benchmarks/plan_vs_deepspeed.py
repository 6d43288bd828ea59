"""Print the planner's model-state estimate against DeepSpeed's real allocations.

    .venv/bin/python benchmarks/plan_vs_deepspeed.py > benchmarks/plan_vs_deepspeed.md

Runs the same two-process measurement as tests/test_plan_vs_deepspeed.py (CPU,
gloo, ~1 minute once DeepSpeed's cpu_adam is built) and prints a markdown table
per configuration and moment: bytes per process (rank 0), estimated vs measured.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))

import test_plan_vs_deepspeed as measurement  # noqa: E402


class _Factory:
    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=name, dir=self.root))
        return path


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        measured = measurement.measured.__wrapped__(_Factory(Path(tmp)))
        rows = measurement.errors_table(measured)
    import platform
    from importlib.metadata import version

    print(f"# Planner model states vs DeepSpeed {version('deepspeed')} allocations\n")
    print(f"Measured on {platform.machine()} {os.cpu_count()} cores, {platform.platform()}; torch "
          f"{version('torch')}, transformers {version('transformers')}, peft {version('peft')}.\n")
    print("Llama, hidden 256, 4 layers, vocab 4096 (~5.0M parameters), 2 gloo processes on CPU, "
          "LoRA r=8 on all 7 linear layers; bytes per process (rank 0). `backward`: after the "
          "second backward; `step`: inside the inner optimizer's second step.\n")
    print("| configuration | moment | estimated MB | DeepSpeed MB | error |")
    print("|---|---|---:|---:|---:|")
    for config, point, want, got, error in rows:
        print(f"| {config} | {point} | {want:.3f} | {got:.3f} | {error:+.2f}% |")
    worst = max(abs(r[4]) for r in rows)
    print(f"\nLargest error: {worst:.2f}%")


if __name__ == "__main__":
    main()
