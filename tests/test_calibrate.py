"""`python -m pipeline calibrate`: what it measures on a CPU, the file it writes and its reader,
the GEMMs it asks a GPU for, the Slurm job it would submit, and the measuring functions
themselves run on the CPU (where the suite runs, no GPU: the GPU path runs them on cuda)."""

from __future__ import annotations

import json
import os
import shlex

import pytest
import torch

from core import calibration
from core import config as config_module
from core.errors import InvalidInput
from pipeline import calibrate, cli
from schedulers.slurm import submit as slurm
from stages import calibrate as measuring
from tests.conftest import REPO, run_cli
from tests.test_slurm_sbatch import login_node  # noqa: F401 -- a fixture: sbatch and srun on PATH, in a workdir

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here is measured, not left null")


def a_calibration(**overrides) -> dict:
    """A hand-written calibration file's content."""
    content = {
        "version": calibration.VERSION, "node": "gpu07", "date": "2026-11-26T05:50:00+00:00",
        "gpu": {"device_name": "NVIDIA H100 80GB HBM3", "catalogue": "h100-80gb", "count": 8, "memory_gib": 79.2},
        "cores_available": 128, "cores_per_process": 16, "processes_per_node": 8,
        "versions": {"torch": "2.13.0", "deepspeed": "0.19.8", "cuda": "13.0"},
        "matmul": [
            {"what": "mlp down fwd", "model": "m", "m": 2048, "k": 22016, "n": 8192, "dtype": "bf16", "tflops": 600.0},
            {"what": "mlp down fwd", "model": "m", "m": 4096, "k": 22016, "n": 8192, "dtype": "bf16", "tflops": 650.0},
            {"what": "o fwd", "model": "m", "m": 2048, "k": 8192, "n": 8192, "dtype": "bf16", "tflops": 500.0},
            {"what": "reference 8192^3", "model": "", "m": 8192, "k": 8192, "n": 8192, "dtype": "bf16",
             "tflops": 700.0},
            {"what": "o fwd", "model": "m", "m": 2048, "k": 8192, "n": 8192, "dtype": "fp32", "tflops": 50.0},
        ],
        "memory_bandwidth_gbs": 2900.0, "host_to_gpu_gbs": 50.0, "gpu_to_host_gbs": 51.0,
        "cpu_adam": {"params_per_s": 1.0e9, "optimizer": "DeepSpeedCPUAdam", "threads": 16, "params": 2**26},
        "collective": {"all_gather_gbs": 360.0, "reduce_scatter_gbs": 350.0, "processes": 8, "bytes": 2**30},
        "settings": {}, "seconds": {"matmul": 20.0}, "notes": [],
    }
    return {**content, **overrides}


# --------------------------------------------------------------------------- the command on a CPU


@needs_cpu_only
def test_calibrate_on_a_cpu_writes_the_cpu_adam_rate_and_null_gpu_fields_saying_why(workdir):
    done = run_cli("calibrate", "tiny", "--quick", cwd=workdir)
    assert done.returncode == 0, done.stderr
    path = workdir / "runs" / "calibration" / "cpu.json"
    result = calibration.load(path)
    assert result.cpu_adam.params_per_s > 0
    assert result.cpu_adam.optimizer == "DeepSpeedCPUAdam"
    # tiny.yaml runs 2 processes per node: each gets half of the cores this process may use
    assert result.processes_per_node == 2
    assert result.cpu_adam.threads == result.cores_per_process == max(1, len(os.sched_getaffinity(0)) // 2)
    assert result.cpu_adam.params == calibrate.QUICK.cpu_adam_params
    # DeepSpeed's own offloaded step on tiny.yaml's model (its 2 layers: fewer than QUICK's parameters)
    step = result.offload_step
    assert (step.model, step.layers, step.zero_stage, step.threads) == (
        "builtin:tiny-llama", 2, 2, result.cpu_adam.threads)
    assert step.params == calibrate.offload_slice(config_module.load_pipeline("tiny"), calibrate.QUICK).params
    assert step.params_per_s == pytest.approx(step.params / step.step_s, rel=0.01) and step.copies_s == 0
    assert "offloaded optimizer step (DeepSpeed, ZeRO-2, 2 layers of builtin:tiny-llama)" in done.stdout
    assert result.gpu is None and result.matmul == ()
    assert None is result.memory_bandwidth_gbs is result.host_to_gpu_gbs is result.gpu_to_host_gbs is result.collective
    assert any("cannot be measured without a GPU" in note for note in result.notes)
    assert result.versions["torch"] == torch.__version__
    # The reader round-trips what was written.
    assert result.to_json() == json.loads(path.read_text())
    assert calibration.from_json(result.to_json(), path) == result
    assert f"written to {os.path.join('runs', 'calibration', 'cpu.json')}" in done.stdout
    assert "CPU Adam (DeepSpeedCPUAdam), 1 process" in done.stdout
    assert "cannot be measured without a GPU" in done.stdout


@needs_cpu_only
def test_require_gpu_on_a_cpu_machine_is_refused_with_exit_2_and_writes_nothing(workdir):
    done = run_cli("calibrate", "tiny", "--quick", "--require-gpu", "--out", workdir / "cal.json", cwd=workdir)
    assert done.returncode == 2, done.stderr
    assert "GPU rates cannot be measured without a GPU" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (workdir / "cal.json").exists()


def test_a_scale_model_is_refused_since_the_node_is_measured_at_the_real_shapes(workdir, capsys):
    assert cli.main(["calibrate", "tiny", "--scale-model"]) == 2
    assert "leave out --scale-model" in capsys.readouterr().err
    assert not (workdir / "runs").exists()


# --------------------------------------------------------------------------- the reader


def test_matmul_tflops_is_the_rate_of_the_nearest_recorded_shape_in_that_dtype(tmp_path):
    path = tmp_path / "h100-80gb.json"
    path.write_text(json.dumps(a_calibration()))
    result = calibration.load(path)
    assert result.matmul_tflops(2048, 22016, 8192, "bf16") == 600.0  # recorded as it is
    assert result.matmul_tflops(3500, 22016, 8192, "bf16") == 650.0  # nearer 4096 than 2048 (by ratio)
    assert result.matmul_tflops(2800, 22016, 8192, "bf16") == 600.0  # 2800 / 2048 = 1.37 < 4096 / 2800 = 1.46
    assert result.matmul_tflops(2048, 8192, 9000, "bf16") == 500.0  # the o projection, not the MLP
    assert result.matmul_tflops(8192, 8192, 8192, "bf16") == 700.0
    assert result.matmul_tflops(2048, 22016, 8192, "fp32") == 50.0  # the only fp32 one, however far
    assert result.matmul_tflops(2048, 22016, 8192, "fp16") is None  # nothing recorded in fp16
    assert result.cpu_adam_params_per_s_per_node == 8e9
    assert result.name == "h100-80gb"


def test_a_file_of_another_version_is_refused_with_exit_2_naming_the_file(tmp_path):
    path = tmp_path / "h100-80gb.json"
    path.write_text(json.dumps(a_calibration(version=2)))
    with pytest.raises(InvalidInput) as err:
        calibration.load(path)
    assert err.value.exit_code == 2
    assert str(path) in err.value.message and "version 2" in err.value.message
    assert "pipeline calibrate" in err.value.message


@pytest.mark.parametrize("text, problem", [
    ("not json {", "not JSON"),
    (json.dumps({"pipeline": "tiny", "stages": {}}), "not a calibration file"),  # e.g. another run-folder file
    (json.dumps(a_calibration(cpu_adam={"params_per_s": -1, "optimizer": "x", "threads": 1, "params": 1})),
     "cpu_adam.params_per_s"),
    (json.dumps(a_calibration(matmul=[{"what": "w", "model": "", "m": 1, "k": 1, "n": 1, "dtype": "int8",
                                       "tflops": 1}])), "matmul.0.dtype"),
])
def test_a_file_that_is_not_a_calibration_file_is_refused_with_exit_2_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(InvalidInput) as err:
        calibration.load(path)
    assert err.value.exit_code == 2
    assert str(path) in err.value.message and problem in err.value.message


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(InvalidInput, match=f"{tmp_path / 'none.json'}: cannot read"):
        calibration.load(tmp_path / "none.json")


def test_the_default_file_is_named_after_the_pipelines_catalogue_gpu(tmp_path):
    spec = config_module.load_pipeline("llama34b_dpo")  # cluster.gpu: a100-80gb; runs_dir: runs
    assert str(calibration.default_path(spec)) == os.path.join("runs", "calibration", "a100-80gb.json")
    tiny = config_module.load_pipeline("tiny")
    assert str(calibration.default_path(tiny)) == os.path.join("runs", "calibration", "cpu.json")
    aliased = tiny.model_copy(update={"cluster": tiny.cluster.model_copy(update={"gpu": "H100-SXM"}),
                                      "runs_dir": str(tmp_path)})
    assert calibration.default_path(aliased) == tmp_path / "calibration" / "h100-80gb.json"


def test_save_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "calibration" / "h100-80gb.json"
    first = calibration.from_json(a_calibration(), "test")
    calibration.save(first, path)
    second = calibration.from_json(a_calibration(node="gpu08"), "test")
    calibration.save(second, path)
    assert calibration.load(path) == second
    assert sorted(p.name for p in path.parent.iterdir()) == ["h100-80gb.json"]


# --------------------------------------------------------------------------- what is measured


def test_the_gemms_are_each_models_layer_and_head_at_each_stages_micro_batch_tokens():
    # CodeLlama-34B: hidden 8192, intermediate 22016, 64 heads and 8 KV heads of 128, vocab 32000.
    # sft packs 1 x 2048 tokens per micro batch; dpo 2048 x 2 (chosen and rejected); both bf16.
    gemms = calibrate.gemms(config_module.load_pipeline("llama34b_dpo"))
    by_what = {(g.what, g.m): g for g in gemms}
    assert len(gemms) == 2 * 5 * 3 + 1  # (q = o, k = v, gate = up, down, lm head) x 3 passes x 2 token counts
    for tokens in (2048, 4096):
        q = by_what[("q fwd", tokens)]  # each linear layer apart, as the model runs them and plan looks them up
        assert (q.k, q.n, q.dtype, q.layout, q.model) == (8192, 8192, "bf16", "nt", "codellama/CodeLlama-34b-hf")
        assert (by_what[("k fwd", tokens)].k, by_what[("k fwd", tokens)].n) == (8192, 1024)
        assert (by_what[("k dX", tokens)].k, by_what[("k dX", tokens)].n) == (1024, 8192)
        assert (by_what[("gate fwd", tokens)].k, by_what[("gate fwd", tokens)].n) == (8192, 22016)
        assert (by_what[("down fwd", tokens)].k, by_what[("down fwd", tokens)].n) == (22016, 8192)
        assert (by_what[("lm head fwd", tokens)].k, by_what[("lm head fwd", tokens)].n) == (8192, 32000)
    # v, o and up have the shapes of k, q and gate: timed once, under the first name
    assert {g.what.rsplit(" ", 1)[0] for g in gemms if g.model} == {"q", "k", "gate", "down", "lm head"}
    # dW of the down projection: [out 8192, in 22016] = dY^T [8192, tokens] @ X [tokens, 22016]
    assert [(g.m, g.k, g.n, g.layout) for g in gemms if g.what == "down dW"] == [(8192, 2048, 22016, "tn"),
                                                                              (8192, 4096, 22016, "tn")]
    reference = [g for g in gemms if not g.model]
    assert [(g.m, g.k, g.n, g.dtype) for g in reference] == [(8192, 8192, 8192, "bf16")]


def test_a_reward_model_has_no_vocabulary_head_to_time_and_each_precision_gets_its_reference():
    spec = config_module.load_pipeline("llama3_8b_rm_6x4090")
    assert {g.what.rsplit(" ", 1)[0] for g in calibrate.gemms(spec) if g.model} == {"q", "k", "gate", "down"}
    tiny = config_module.load_pipeline("tiny")  # fp32, the tiny Llama
    references = [g for g in calibrate.gemms(tiny) if not g.model]
    assert [(g.m, g.dtype) for g in references] == [(8192, "fp32")]


def test_the_slurm_job_is_one_task_with_the_clusters_section_and_every_core_of_the_stages_processes(login_node):  # noqa: F811 -- the imported login_node fixture
    (login_node / "containers").mkdir()
    (login_node / "containers" / "pinned.sif").write_text("")
    spec = config_module.load_pipeline("llama34b_dpo")  # slurm, partition gpu, 8 GPUs x 12 cpus, a container
    executor = slurm.calibration_executor(spec)
    script = slurm.sbatch_script(executor)
    assert "#SBATCH --partition=gpu" in script
    assert "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --cpus-per-task=96" in script  # 8 processes x 12: cores // 8 is one process's share
    assert "#SBATCH --time=30" in script
    assert "#SBATCH --mem=0" in script
    assert "#SBATCH --requeue" not in script  # a stage job's; a calibration that ran out of time is just rerun
    command = shlex.split(executor.python)
    assert command[:3] == ["apptainer", "exec", "--nv"]
    assert command[command.index("--bind") + 1].split(",") == [str(login_node), str(REPO)]
    assert command[-2:] == [str(login_node / "containers" / "pinned.sif"), "python"]


# --------------------------------------------------------------------------- the measuring functions, on a CPU


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_a_gemm_is_timed_in_each_layout(layout):
    assert measuring.gemm_tflops(96, 64, 32, "fp32", layout, torch.device("cpu"), repeats=2) > 0


def test_matmul_rates_stop_starting_gemms_when_the_budget_is_spent_and_say_so():
    gemms = calibrate.gemms(config_module.load_pipeline("tiny"))[:3]
    notes: list[str] = []
    rates = measuring.matmul_rates(gemms, torch.device("cpu"), repeats=1, budget_s=-1, notes=notes)
    assert rates == [] and notes == ["matmul: 3 of 3 GEMMs not measured: the -1 s budget ran out"]
    rates = measuring.matmul_rates(gemms, torch.device("cpu"), repeats=1, budget_s=60, notes=notes)
    assert [(r["m"], r["k"], r["n"], r["what"]) for r in rates] == [(g.m, g.k, g.n, g.what) for g in gemms]
    assert all(r["tflops"] > 0 for r in rates)


def test_a_device_copy_is_timed():
    assert measuring.memory_bandwidth_gbs(torch.device("cpu"), 2**22, repeats=2) > 0


@pytest.mark.slow
def test_the_collectives_run_between_spawned_processes_and_a_stuck_one_is_stopped():
    notes: list[str] = []
    rates = measuring.collective_rates(2, "gloo", 2**20, 2, timeout_s=300, notes=notes)
    assert notes == []
    assert rates["processes"] == 2 and rates["bytes"] == 2**20
    assert rates["all_gather_gbs"] > 0 and rates["reduce_scatter_gbs"] > 0
    # Processes that do not finish in time (a million repeats) are stopped, and the note says so.
    assert measuring.collective_rates(2, "gloo", 2**20, 10**6, timeout_s=5, notes=notes) is None
    assert notes == ["collective: the 2 processes did not finish within 5 s: stopped, not measured"]


# --------------------------------------------------------------------------- what the plan takes from it


def _h100_pipeline(tmp_path) -> config_module.PipelineSpec:
    return config_module.PipelineSpec.model_validate({
        "name": "p", "runs_dir": str(tmp_path / "runs"),
        "cluster": {"executor": "slurm", "gpu": "h100-80gb", "gpus_per_node": 8, "cpus_per_task": 16},
        "defaults": {"zero_stage": 3, "optimizer_offload": True, "gradient_checkpointing": True,
                     "micro_batch_size": 1, "max_len": 2048},
        "stages": [{"name": "sft", "kind": "sft", "model": "codellama/CodeLlama-34b-hf", "global_batch_size": 64,
                    "data": {"path": str(tmp_path / "rows.jsonl")}}],
    })


def test_the_plan_takes_the_nodes_rates_from_its_calibration_file_and_says_so(tmp_path):
    from pipeline import plan

    spec = _h100_pipeline(tmp_path)
    built_in = plan.plan_pipeline(spec)[0].time
    assert built_in.calibration is None
    assert "built in (no calibration file" in plan.format_plan(plan.plan_pipeline(spec))
    # every GEMM at half the H100's recorded 708 TFLOP/s, and DeepSpeedCPUAdam alone at 1e9 parameters/s
    slow = [{**g, "tflops": 354.0} for g in a_calibration()["matmul"]]
    calibration.save(calibration.from_json(a_calibration(matmul=slow), "test"), calibration.default_path(spec))
    measured = plan.plan_pipeline(spec)[0].time
    assert measured.calibration == "calibrated on gpu07, 2026-11-26"
    assert measured.compute_terms["matmul"] == pytest.approx(2 * built_in.compute_terms["matmul"])
    # the host term stays the records' (it is more than the optimizer alone), and says what was not used
    host = next(line for line in measured.sources if line.startswith("host Adam"))
    assert host.startswith("host Adam 1.33e9 params/s per process (records: 16 cores per process")
    assert "calibrated DeepSpeedCPUAdam alone 1e9 params/s on 16 cores (gpu07, 2026-11-26) not used" in host
    n = plan.plan_pipeline(spec)[0].trained_params
    assert measured.work["host_adam_params"] == pytest.approx(n / 8)
    assert measured.offload_s - measured.work["host_copies_s"] == pytest.approx(
        built_in.offload_s - built_in.work["host_copies_s"])
    # the copies: the slower of the measured directions, 50 GB/s
    assert measured.work["host_copies_s"] == pytest.approx(built_in.work["host_copies_s"] * 55.2 / 50.0)
    assert "calibrated on gpu07, 2026-11-26" in plan.format_plan(plan.plan_pipeline(spec))


def test_the_calibrated_offloaded_step_replaces_the_records_host_rate_and_the_plan_says_so(tmp_path):
    from pipeline import plan

    spec = _h100_pipeline(tmp_path)
    built_in = plan.plan_pipeline(spec)[0].time
    step = {"params_per_s": 2.0e8, "model": "codellama/CodeLlama-34b-hf", "layers": 1, "params": 696279040,
            "zero_stage": 3, "threads": 16, "step_s": 3.55, "copies_s": 0.03}
    calibration.save(calibration.from_json(a_calibration(offload_step=step), "test"), calibration.default_path(spec))
    measured = plan.plan_pipeline(spec)[0].time
    host = measured.offload_s - measured.work["host_copies_s"]
    assert host == pytest.approx(measured.work["host_adam_params"] / 2.0e8)
    # the records' 1.33e9 per process (16 cores) against the node's 2e8: the host term 6.6x as long
    assert host == pytest.approx(6.64 * (built_in.offload_s - built_in.work["host_copies_s"]), rel=0.01)
    line = next(line for line in measured.sources if line.startswith("host Adam"))
    assert line == ("host Adam 0.2e9 params/s per process (calibrated: gpu07, 2026-11-26: DeepSpeed's offloaded "
                    "step on 1 layer of codellama/CodeLlama-34b-hf, ZeRO-3, 16 cores)")


@pytest.mark.parametrize("content, problem", [
    (None, "cannot read the calibration file"),
    ("not json {", "not a calibration file: not JSON"),
    (json.dumps(a_calibration()), "measured on NVIDIA H100 80GB HBM3 (h100-80gb), but this pipeline runs on the CPU "
                                  "(cluster.gpus_per_node: 0)"),
])
def test_plan_refuses_a_calibration_file_it_cannot_use_on_a_cpu_pipeline_too(tmp_path, content, problem):
    from tests.conftest import tiny_pipeline, write_pipeline

    config = write_pipeline(tmp_path, tiny_pipeline())
    path = tmp_path / "given.json"
    if content is not None:
        path.write_text(content)
    done = run_cli("plan", config, "--calibration", path, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{path}: {problem}" in done.stderr and "Traceback" not in done.stderr


def test_a_cpu_pipeline_takes_a_calibration_measured_without_a_gpu(tmp_path):
    from pipeline import plan
    from tests.conftest import tiny_pipeline

    spec = config_module.PipelineSpec.model_validate({**tiny_pipeline(), "runs_dir": str(tmp_path)})
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(a_calibration(gpu=None, matmul=[], memory_bandwidth_gbs=None, host_to_gpu_gbs=None,
                                             gpu_to_host_gbs=None, collective=None)))
    assert plan.plan_pipeline(spec, calibration=path)


def test_a_calibration_of_another_gpu_is_refused_naming_the_file(tmp_path):
    from pipeline import plan

    spec = _h100_pipeline(tmp_path)
    a100 = {"device_name": "NVIDIA A100-SXM4-80GB", "catalogue": "a100-80gb", "count": 8, "memory_gib": 79.3}
    path = tmp_path / "a100.json"
    path.write_text(json.dumps(a_calibration(gpu=a100)))
    with pytest.raises(InvalidInput) as err:
        plan.plan_pipeline(spec, calibration=path)
    assert str(path) in err.value.message and "a100-80gb" in err.value.message and "h100-80gb" in err.value.message


def test_a_calibration_measured_without_a_gpu_is_refused_for_a_gpu_pipeline(tmp_path):
    from pipeline import plan

    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(a_calibration(gpu=None, matmul=[], memory_bandwidth_gbs=None, host_to_gpu_gbs=None,
                                             gpu_to_host_gbs=None, collective=None)))
    with pytest.raises(InvalidInput, match=f"{path}: measured without a GPU, but cluster.gpu is h100-80gb"):
        plan.plan_pipeline(_h100_pipeline(tmp_path), calibration=path)
