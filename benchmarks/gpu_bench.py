"""GPU benchmark: the project's SFT and DPO stages against TRL's trainers on one GPU,
and the planner's memory estimate against what the stages really use.

    python3 benchmarks/gpu_bench.py run [--cases throughput|memory|slice|all|NAME,...] [--out DIR] [--budget-s S]
    python3 benchmarks/gpu_bench.py report DIR [DIR ...] [--results benchmarks/RESULTS.md]
    python3 benchmarks/gpu_bench.py run --device cpu --shape tiny      # the dry run, on a CPU, in minutes

`run` builds a random-init model of a named shape (default Llama-3.2-1B's; no
download) and synthetic rows with a skewed length mix, then runs each case in
its own subprocess with a timeout, writing OUT/<case>.json as soon as it ends,
and prints a summary table last. Running it again goes on where it stopped.
`report` turns one or more such folders into the tables of RESULTS.md (between
its markers; the rest of the file is kept). `make bench-gpu` does both.

Run from the repository root with plain python3; needs torch and transformers,
and for the project's cases what the project needs (deepspeed, submitit,
pydantic, datasets, peft); TRL and Liger are optional (their cases are skipped,
with the reason, when missing). See benchmarks/gpu/ for the parts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu import cases, report, runner, workload  # noqa: E402

DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_bench.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run cases, each in its own subprocess; results to OUT/<case>.json")
    run.add_argument("--cases", default="throughput,memory,slice",
                     help="comma-separated case or group names: throughput, memory, slice (the 34B slice), rl (a GRPO "
                          "rollout, benchmarks/gpu/rl.py), all, "
                          "or e.g. project-sft,trl-sft-packed,project-sft+packing (default: throughput,memory,slice)")
    run.add_argument("--out", help="small results (case JSONs, log tails, RESULTS.md); "
                                   "default benchmarks/out/gpu-DATE (cpu-dry-DATE on a CPU)")
    run.add_argument("--work", help="model, data and run folders (large); default benchmarks/out/work-SHAPE")
    run.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    run.add_argument("--shape", choices=sorted(workload.SHAPES),
                     help="model shape (default llama-3.2-1b on a GPU, tiny on a CPU)")
    run.add_argument("--max-len", type=int, help="longest row in tokens (default: the shape's, 2048 for 1B)")
    run.add_argument("--steps", type=int, help="optimizer steps per throughput case (default 10 on a GPU, 4 on a CPU)")
    run.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of throughput (default 2)")
    run.add_argument("--memory-steps", type=int, default=3, help="optimizer steps per memory-matrix case (default 3)")
    run.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=2)
    run.add_argument("--gradient-checkpointing", choices=["auto", "on", "off"], default="auto",
                     help="auto: off for SFT, on for DPO (both stacks alike)")
    run.add_argument("--micro-batch-size", type=int, default=4)
    run.add_argument("--global-batch-size", type=int, default=32)
    run.add_argument("--learning-rate", type=float, default=1e-5)
    run.add_argument("--gpu", help="core/hardware.py GPU name, when the device name is not recognised")
    run.add_argument("--budget-s", type=float, help="start no case that would end past this many seconds")
    run.add_argument("--case-timeout-s", type=float, help="cap every case's own timeout (defaults 120-420 s)")
    run.add_argument("--force", action="store_true", help="re-run cases that finished earlier")
    run.add_argument("--no-report", action="store_true", help="skip writing OUT/RESULTS.md")

    rep = sub.add_parser("report", help="case JSONs -> the tables of RESULTS.md")
    rep.add_argument("dirs", nargs="+", type=Path, help="output folders of `run` (later ones win per case)")
    rep.add_argument("--results", type=Path, default=DEFAULT_RESULTS)

    for name in ("case", "prepare"):  # what `run` starts in a subprocess
        inner = sub.add_parser(name, help=argparse.SUPPRESS)
        if name == "case":
            inner.add_argument("name")
        inner.add_argument("--out", required=True)
        inner.add_argument("--work", required=True)

    args = parser.parse_args(argv)
    if args.command == "run":
        settings = run_settings(args, argv if argv is not None else sys.argv[1:])
        runner.run(settings, args.cases, args.force)
        if not args.no_report:
            report.write(report.load([Path(settings["out"])]), Path(settings["out"]) / "RESULTS.md")
        return 0
    if args.command == "report":
        results = report.load(args.dirs)
        report.write(results, args.results)
        print(f"wrote {args.results} from {len(results['cases'])} case results")
        return 0
    return inner_command(args)


def run_settings(args, argv: list[str]) -> dict:
    device = args.device
    if device == "auto":
        device = "cuda" if _has_gpu() else "cpu"
    shape = args.shape or ("llama-3.2-1b" if device == "cuda" else "tiny")
    max_len = args.max_len or workload.SHAPES[shape]["max_len"]
    steps = args.steps or (10 if device == "cuda" else 4)
    today = datetime.date.today().strftime("%Y%m%d")
    out = Path(args.out or REPO / "benchmarks" / "out" / (f"gpu-{today}" if device == "cuda" else f"cpu-dry-{today}"))
    work = Path(args.work or REPO / "benchmarks" / "out" / f"work-{shape}")
    if args.global_batch_size % args.micro_batch_size:
        raise SystemExit("--global-batch-size must be a multiple of --micro-batch-size")
    return {
        "command": "python3 benchmarks/gpu_bench.py " + shlex.join(argv),
        "device": device,
        "shape": shape,
        "max_len": max_len,
        "steps": steps,
        "warmup_steps": args.warmup_steps,
        "memory_steps": args.memory_steps,
        "precision": "bf16" if device == "cuda" else "fp32",
        "zero_stage": args.zero_stage,
        "gradient_checkpointing": {"auto": "auto", "on": True, "off": False}[args.gradient_checkpointing],
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "learning_rate": args.learning_rate,
        "gpu": args.gpu,
        # enough rows for every step of the longest case, and a little more
        "rows": args.global_batch_size * (max(steps, args.memory_steps) + 4),
        "budget_s": args.budget_s,
        "case_timeout_s": args.case_timeout_s,
        "out": str(out.resolve()),
        "work": str(work.resolve()),
    }


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def inner_command(args) -> int:
    """The body of one case (or the workload), in the subprocess `run` started."""
    settings = json.loads((Path(args.out) / "settings.json").read_text())
    work = Path(args.work)
    try:
        if args.command == "prepare":
            workload.prepare(work / "workload", settings["shape"], settings["max_len"], settings["rows"],
                             settings["precision"], settings["device"])
            return 0
        case = cases.lookup(args.name)
        folder = work / case.name
        folder.mkdir(parents=True, exist_ok=True)
        if case.kind == "env":
            cases.run_env(folder, settings)
        elif case.kind == "matmul":
            cases.run_matmul(folder, settings)
        elif case.kind == "slice":  # builds its own workload
            from benchmarks.gpu import slice as slice_34b

            slice_34b.run(case, folder, settings)
        else:
            info = workload.load(work / "workload")
            if case.kind == "rl":  # the shared model, made to end its completions like RL's
                from benchmarks.gpu import rl

                rl.run(case, folder, settings, info)
            elif case.kind == "project":
                from benchmarks.gpu import project

                project.run(case, folder, settings, info)
            else:
                from benchmarks.gpu import hf_trl

                hf_trl.run(case, folder, settings, info)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 -- any failure of a case (an interrupt too) is its result: 1
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
