"""SFT end to end through `python -m pipeline run`: real DeepSpeed, 2 gloo processes."""

from __future__ import annotations

import copy
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, read_result, run_cli, tiny_pipeline, write_pipeline

pytestmark = pytest.mark.slow


def run_pipeline(workdir, spec):
    result = run_cli("run", write_pipeline(workdir, spec), cwd=workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def shm_buffers() -> set[Path]:
    """DeepSpeed's shared-memory allreduce buffers in /dev/shm."""
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


# DeepSpeed's name for a CPU process's buffer: deepspeed_allreduce_buffer_<uid>_<master address>_<master port>_<rank>.
BUFFER_NAME = re.compile(r"deepspeed_allreduce_buffer_\d+_(?P<address>.+)_(?P<port>\d+)_(?P<rank>\d+)")


@dataclass
class Trained:
    workdir: Path  # runs/t/sft is the stage
    spec: dict
    stdout: str
    shm_before: set[Path]  # shm_buffers() before the run
    shm_after: set[Path]  # and after it


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`run` of the default SFT stage (40 steps) with the given defaults, once per module for each
    set of them: the tests that only read a finished run share it."""
    done = {}

    def run(**defaults) -> Trained:
        key = json.dumps(defaults, sort_keys=True)
        if key not in done:
            workdir = tmp_path_factory.mktemp("sft")
            spec = tiny_pipeline(defaults=defaults)
            before = shm_buffers()
            stdout = run_pipeline(workdir, spec).stdout
            done[key] = Trained(workdir, spec, stdout, before, shm_buffers())
        return done[key]

    return run


# ZeRO-2, fp32, saving every 20 steps: the zero2 case below, the uninterrupted run the resumed one
# is compared with, the stage whose /dev/shm leftovers are counted and the finished stage a second
# `run` skips.
ZERO2 = {"zero_stage": 2, "precision": "fp32", "optimizer_offload": False, "save_interval": 20}


@pytest.mark.parametrize(
    "defaults",
    [pytest.param(ZERO2, id="zero2"),  # `make test`'s one whole training run (the others read it too)
     pytest.param({"zero_stage": 3, "precision": "fp32", "optimizer_offload": False}, id="zero3",
                  marks=pytest.mark.e2e),
     pytest.param({"zero_stage": 3, "precision": "bf16", "optimizer_offload": False}, id="zero3-bf16",
                  marks=[pytest.mark.e2e, pytest.mark.stack_free]),
     pytest.param({"zero_stage": 2, "precision": "fp32", "optimizer_offload": True}, id="zero2-offload",
                  marks=pytest.mark.e2e)],
)
def test_sft_eval_loss_falls_and_the_model_reloads_and_generates(trained, defaults):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained(**defaults)
    workdir, output = run.workdir, run.stdout
    run_dir = workdir / "runs" / "t" / "sft"
    result = read_result(run_dir)
    assert result["world_size"] == 2
    # No GPUs asked for: two CPU processes, and the log and result say so.
    assert result["devices"]["type"] == "cpu" and result["devices"]["count"] == 2
    assert result["devices"]["name"]
    assert f"device cpu ({result['devices']['name']})" in output
    assert result["final_eval_loss"] < 0.5 * result["initial_eval_loss"]

    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(5, 41, 5))
    assert steps[-1]["loss"] < steps[0]["loss"]

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    prompt = tokenizer("sort 3142 =", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    # The exported weights are the trained ones: their eval loss is what the stage reported.
    assert not torch.equal(
        model.model.embed_tokens.weight,
        AutoModelForCausalLM.from_pretrained(
            workdir / "runs" / "t" / "builtin" / "tiny-llama").model.embed_tokens.weight,
    )


@pytest.mark.e2e
def test_resuming_from_a_checkpoint_continues_the_same_loss_curve(trained, workdir):
    first = trained(**ZERO2)
    spec = first.spec
    whole = first.workdir / "runs" / "t" / "sft"
    # Every save_interval steps, and after the last one (40).
    assert sorted(p.name for p in (whole / "checkpoints").glob("step-*")) == ["step-00000020", "step-00000040"]
    assert (whole / "checkpoints" / "latest").read_text() == "step-00000040"

    # A second run folder that holds what an interrupted run would have left at step 20.
    other = workdir / "resumed"
    other.mkdir()
    cut = other / "runs" / "t" / "sft"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step-00000020", cut / "checkpoints" / "step-00000020")
    (cut / "checkpoints" / "latest").write_text("step-00000020")
    shutil.copy(whole / "spec.json", cut / "spec.json")
    (cut / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in (whole / "metrics.jsonl").read_text().splitlines()[:5])
    )

    result = run_pipeline(other, spec)
    assert "resuming sft" in result.stdout
    assert "resumed from checkpoint step-00000020" in result.stdout

    def losses(run_dir):
        return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}

    resumed, uninterrupted = losses(cut), losses(whole)
    assert sorted(resumed) == sorted(uninterrupted)
    for step in (25, 30, 35, 40):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-4)
    assert read_result(cut)["final_eval_loss"] == pytest.approx(read_result(whole)["final_eval_loss"], rel=1e-4)
    assert read_result(cut)["initial_eval_loss"] == read_result(whole)["initial_eval_loss"]


@pytest.mark.e2e
def test_lora_trains_and_exports_a_merged_plain_model(workdir):
    from transformers import AutoModelForCausalLM

    spec = tiny_pipeline(defaults={"lora": {"rank": 8, "alpha": 16}, "learning_rate": 1e-2})
    run_pipeline(workdir, spec)
    run_dir = workdir / "runs" / "t" / "sft"
    result = read_result(run_dir)
    # A random base with frozen embeddings and head learns slowly through adapters alone.
    assert result["final_eval_loss"] < result["initial_eval_loss"] - 0.4
    assert not (run_dir / "model" / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    names = [n for n, _ in model.named_parameters()]
    assert not any("lora" in n for n in names)
    base = AutoModelForCausalLM.from_pretrained(workdir / "runs" / "t" / "builtin" / "tiny-llama")
    # Adapters were on the projections only: embeddings untouched, projections changed.
    assert torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)


def test_a_finished_stage_leaves_no_deepspeed_buffers_in_shared_memory(trained):
    run = trained(**ZERO2)
    # Each CPU process's ~70 MB allreduce buffer; left behind, a test suite fills the RAM. A buffer
    # that appeared during the stage is its leftover if its name has the stage's master port, or
    # a name DeepSpeed's scheme cannot be read from; one with another port is another DeepSpeed
    # run's on this machine (other suites, other engineers), created or left there meanwhile.
    master = re.search(r"master \S+:(\d+),", run.stdout)  # the stage's log line: "... master vm:29500, ..."
    assert master, run.stdout[-3000:]
    new = {path.name: BUFFER_NAME.fullmatch(path.name) for path in run.shm_after - run.shm_before}
    assert not [name for name, parts in new.items() if parts is None or parts["port"] == master.group(1)]


@pytest.mark.e2e
@pytest.mark.stack_free
def test_a_finished_stage_is_skipped_and_a_changed_one_starts_over(trained, workdir):
    finished = trained(**ZERO2)
    again = run_pipeline(finished.workdir, finished.spec)
    assert "skipped" in again.stdout

    # The change in a copy of the run folder: the finished run stays as the other tests read it.
    shutil.copytree(finished.workdir / "runs", workdir / "runs")
    spec = copy.deepcopy(finished.spec)
    spec["stages"][0]["learning_rate"] = 1e-3
    changed = run_pipeline(workdir, spec)
    assert "previous outputs moved to" in changed.stdout
    aside = list((workdir / "runs" / "t").glob("sft.superseded-*"))
    assert len(aside) == 1 and (aside[0] / "result.json").exists()
    assert (workdir / "runs" / "t" / "sft" / "result.json").exists()


@pytest.mark.e2e
@pytest.mark.stack_free
def test_rows_left_with_nothing_to_learn_are_dropped_and_counted_in_the_result(workdir):
    import json

    # 38 rows fit max_len 48; in 2 the prompt alone is 53 tokens (<s> + 52 characters), so
    # the cut leaves no response token: 2 of 40 rows (5%) is within max_truncated_share.
    rows = ([{"prompt": "sort 321 =", "response": " 123"}] * 38
            + [{"prompt": f"sort {'9' * 45} =", "response": " 9"}] * 2)
    (workdir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    spec = tiny_pipeline()
    spec["stages"][0].update(max_steps=2, data={"path": "train.jsonl", "eval_split": "eval.jsonl"})
    output = run_pipeline(workdir, spec).stdout
    assert "note: stages[0] (sft): max_len 48 (nothing to learn: no response token left): train: 2 of 40 rows " \
        "lose tokens, 2 have nothing to learn; eval: 0 of 8 rows lose tokens, 0 have nothing to learn" in output
    run_dir = workdir / "runs" / "t" / "sft"
    result = read_result(run_dir)
    assert result["truncation"] == {"max_len": 48, "train": {"rows": 40, "cut": 2, "dropped": 2},
                                    "eval": {"rows": 8, "cut": 0, "dropped": 0}}
    assert result["train_rows"] == 38
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.out"))
    assert "dropped 2 train and 0 eval rows with nothing to learn within max_len 48" in logs
