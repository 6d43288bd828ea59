"""The same pipeline file trains to the same numbers however many cores the machine has.

torch's element-wise kernels cut a tensor into one chunk per thread and finish each chunk's
ragged end with scalar code, which rounds differently from the vector loop (silu, sigmoid,
gelu): a stage's numbers follow its processes' thread count. So a CPU stage takes its thread
count from the pipeline file (stages/distributed.py), never from the machine it lands on.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import read_metrics, read_result, run_cli, tiny_pipeline, write_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.stack_free]

# Put first on PYTHONPATH: every process of the run (the stage processes too) sees
# TEST_CPU_COUNT cores, and the next sitecustomize on sys.path still runs (tests/pinned_shims,
# which chains on in turn: the flag stops the two from running each other forever).
CORES_SHIM = '''\
import importlib.machinery, importlib.util, os, sys
if not getattr(sys, "_test_cores_shim", False):
    sys._test_cores_shim = True
    if os.environ.get("TEST_CPU_COUNT"):
        _cores = int(os.environ["TEST_CPU_COUNT"])
        os.cpu_count = lambda: _cores
        os.sched_getaffinity = lambda pid: set(range(_cores))
    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
    if _spec is not None:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''

# What a record measures about the machine (time, memory), not what the stage learned.
MACHINE_KEYS = {"time", "tokens_per_s", "step_s", "eta_s", "mfu", "host_rss_gib", "gpu_mem_peak_gib",
                "gpu_mem_reserved_gib"}
LEARNED = ("initial_eval_accuracy", "eval_accuracy", "eval_margin", "eval_loss", "reward_mean", "reward_std")


def test_a_stage_trains_to_the_same_numbers_on_a_machine_with_more_cores(tmp_path, monkeypatch):
    # A packed reward-model stage: its MLP activations span several threads' chunks.
    spec = tiny_pipeline(stages=[{
        "name": "rm", "kind": "rm", "model": "builtin:tiny-llama",
        "data": {"path": "builtin:digits", "eval_split": "eval"},
        "max_steps": 10, "learning_rate": 1e-3, "micro_batch_size": 16,
    }])
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(CORES_SHIM)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])))
    runs = {}
    for cores in (2, 8):  # a core count / processes rule would give 1 thread per process, then 4
        workdir = tmp_path / f"cores-{cores}"
        workdir.mkdir()
        monkeypatch.setenv("TEST_CPU_COUNT", str(cores))
        result = run_cli("run", write_pipeline(workdir, spec), cwd=workdir)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        run_dir = workdir / "runs" / "t" / "rm"
        runs[cores] = (read_result(run_dir),
                       [{k: v for k, v in m.items() if k not in MACHINE_KEYS} for m in read_metrics(run_dir)])

    (few, few_metrics), (many, many_metrics) = runs[2], runs[8]
    assert [m["step"] for m in few_metrics] == [0, 5, 10, 10]
    assert many_metrics == few_metrics  # every step's loss, grad norm, margin: exactly
    assert {k: many[k] for k in LEARNED} == {k: few[k] for k in LEARNED}
    assert few["devices"]["threads"] == many["devices"]["threads"] == 1  # the file says nothing: one each
