"""The planner's model-state bytes against what DeepSpeed really allocates.

Two gloo processes (torchrun) build a small Llama through the stages' own loading
path (stages.models, stages.engine.deepspeed_config, stages.engine.initialize) for
each configuration: ZeRO 0/1/2/3, fp32 and bf16, with and without optimizer
offload and LoRA, plus reward models (scalar head). They train two steps and
measure the tensors DeepSpeed holds, by walking the engine: the module's
parameters (their ZeRO-3 `ds_tensor` shards and persistent whole copies), the
optimizer wrapper's flat buffers and gradient partitions, and the inner
optimizer's fp32 master partitions and Adam states. Each storage is counted once.

Two moments are measured on the second step: after backward (weights, gradients,
optimizer states at rest) and inside the inner optimizer's step (plus the fp32
gradient copy the step works on). On a CPU everything lives in host memory, so
the planner's per-process GPU and host items are summed; the planner runs in its
CPU mode, which uses the same 5e5-element buckets as deepspeed_config(on_gpu=False).

This file is also the worker: torchrun runs it with --worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Big enough that padding and small tensors are noise: ~5M parameters, 4 layers.
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
LORA = {"rank": 8}
WORLD = 2
TOLERANCE = 0.05
CATEGORIES = ("weights", "gradients", "optimizer", "buffers")


def _configs() -> list[dict]:
    configs = []
    for zero in (0, 1, 2, 3):  # ZeRO-3 last: its construction hooks are the ones that linger
        for precision in ("fp32", "bf16"):
            for offload in ((False, True) if zero else (False,)):
                for lora in (None, LORA):
                    configs.append({"kind": "sft", "precision": precision, "zero_stage": zero,
                                    "optimizer_offload": offload, "lora": lora})
    # Reward models: a scalar head instead of the lm_head; with LoRA peft trains the head in full.
    configs[-1:-1] = [
        {"kind": "rm", "precision": "bf16", "zero_stage": 2, "optimizer_offload": False, "lora": LORA},
        {"kind": "rm", "precision": "bf16", "zero_stage": 3, "optimizer_offload": False, "lora": None},
        {"kind": "rm", "precision": "bf16", "zero_stage": 3, "optimizer_offload": False, "lora": LORA},
    ]
    return configs


CONFIGS = _configs()


def config_id(config: dict) -> str:
    parts = [config["kind"], config["precision"], f"zero{config['zero_stage']}"]
    parts += ["offload"] if config["optimizer_offload"] else []
    parts += ["lora"] if config["lora"] else []
    return "-".join(parts)


def stage_spec(config: dict, model_dir: str):
    from core.schemas.rm import RMStage
    from core.schemas.sft import SFTStage

    cls = RMStage if config["kind"] == "rm" else SFTStage
    fields = {k: v for k, v in config.items() if v is not None}
    return cls.model_validate({"name": "m", "model": model_dir, "data": {"path": "builtin:digits"},
                               "micro_batch_size": 2, "max_len": 32, **fields})


# --------------------------------------------------------------------------- what the planner says


def estimated(config: dict, model_dir: str) -> dict:
    """Per-process bytes by category at the two moments, from pipeline.plan in CPU mode."""
    from core.shapes import resolve_shape
    from pipeline import plan

    stage = stage_spec(config, model_dir)
    knobs = plan.Knobs.from_stage(stage)
    hw = plan.Hardware(gpu=None, gpus_per_node=0, processes_per_node=WORLD, gpu_memory_bytes=None,
                       host_memory_bytes=None)
    models, workload = plan.stage_models(knobs, resolve_shape(model_dir))
    memory = plan.estimate_memory(models, workload, knobs, hw)
    out = {}
    for point, phases in (("backward", ("always",)), ("step", ("always", "optimizer step"))):
        out[point] = {c: memory.per_process((c,), phases) for c in CATEGORIES}
    return out


# --------------------------------------------------------------------------- what DeepSpeed holds (worker side)


def _classify(path: str) -> str:
    grads = ("averaged_gradients", "grad_partitions_flat_buffer", "grads_in_partition", "all_grad_tensors",
             "accumulated_grads_in_cpu")
    if path.endswith(".grad") or any(k in path for k in grads):
        return "gradients"
    if any(k in path for k in ("ipg_buckets", "temp_grad_buffer", "param_buffer_of_bit16_for_cpu_offload")):
        return "buffers"
    if path.startswith("param:") or any(k in path for k in ("bit16_groups_flat", "fp16_partitioned_groups_flat",
                                                             "lp_param_buffer", "fp16_groups_flat")):
        return "weights"
    if ".state[" in path or any(k in path for k in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                                                     "fp32_groups_flat")):
        return "optimizer"
    return "other"


def _walk(obj, path: str, found: dict, seen: set, depth: int = 0) -> None:
    """Collect every tensor storage reachable from DeepSpeed's objects: {data_ptr: (path, bytes)}."""
    import torch

    if depth > 8:
        return
    if torch.is_tensor(obj):
        if obj.device.type != "meta":
            storage = obj.untyped_storage()
            if storage.nbytes() > 0:
                found.setdefault(storage.data_ptr(), (path, storage.nbytes()))
        if obj.grad is not None:
            _walk(obj.grad, path + ".grad", found, seen, depth + 1)
        for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
            if torch.is_tensor(value):  # ds_tensor (ZeRO-3 shard) and friends
                _walk(value, f"{path}.{name}", found, seen, depth + 1)
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            label = key if isinstance(key, (str, int)) else "key"
            if torch.is_tensor(key):
                _walk(key, f"{path}[key]", found, seen, depth + 1)
            _walk(value, f"{path}[{label}]", found, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _walk(value, f"{path}[{i}]", found, seen, depth + 1)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        for name, value in list(vars(obj).items()):
            if name not in ("module", "_modules", "client_model"):
                _walk(value, f"{path}.{name}", found, seen, depth + 1)
        if isinstance(obj, torch.optim.Optimizer):
            _walk(obj.state, f"{path}.state", found, seen, depth + 1)


def _measure(engine) -> dict:
    found: dict = {}
    seen: set = set()
    for name, param in engine.module.named_parameters():
        _walk(param, f"param:{name}", found, seen)
    _walk(engine.optimizer, "opt", found, seen)
    sums = {c: 0 for c in CATEGORIES + ("other",)}
    others = []
    for path, nbytes in found.values():
        category = _classify(path)
        sums[category] += nbytes
        if category == "other":
            others.append((path, nbytes))
    sums["other_paths"] = sorted(others, key=lambda x: -x[1])[:5]
    return sums


def _run_config(config: dict, model_dir: str, world: int, rank: int) -> dict:
    import gc

    import torch

    from stages import engine, models, runner

    models._live_ds_configs.clear()  # a ZeRO-3 config's HfDeepSpeedConfig must not shape the next model
    gc.collect()  # the previous configuration's engine (cheap: the imported world is frozen)
    stage = stage_spec(config, model_dir)
    ds_config = engine.deepspeed_config(stage, world, MODEL["hidden_size"], False,
                                        runner.trained_params(stage, model_dir))
    if config["kind"] == "rm":
        model = models.load_reward_model(model_dir, stage, ds_config, on_gpu=False, pad_token_id=0)
    else:
        model = models.load_causal_lm(model_dir, stage, ds_config, on_gpu=False)
    ds = engine.initialize(model, stage, ds_config, total_steps=10)

    captured: dict = {}
    inner = ds.optimizer.optimizer if hasattr(ds.optimizer, "optimizer") else ds.optimizer
    original_step = inner.step
    current = {"step": 0}

    def measuring_step(*args, **kwargs):  # inside the inner optimizer step: the step-time peak
        if current["step"] == 2 and "step" not in captured:
            captured["step"] = _measure(ds)
        return original_step(*args, **kwargs)

    inner.step = measuring_step
    generator = torch.Generator().manual_seed(rank)
    for step in (1, 2):
        current["step"] = step
        ids = torch.randint(1, MODEL["vocab_size"], (2, 32), generator=generator)
        if config["kind"] == "rm":
            loss = ds(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().sum()
        else:
            loss = ds(input_ids=ids, labels=ids).loss
        ds.backward(loss)
        del loss
        if step == 2:
            captured["backward"] = _measure(ds)
        ds.step()
    if hasattr(ds, "destroy"):
        ds.destroy()
    return captured


def worker(model_dir: str, out_dir: str, configs_json: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    extra = {}
    if rank == 0:
        from transformers import LlamaConfig, LlamaForCausalLM

        from core import tiny

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(model_dir)
        tiny_dir = Path(out_dir) / "tiny-llama"
        tiny.write_tiny_llama(tiny_dir)
        tiny_model = LlamaForCausalLM.from_pretrained(tiny_dir)
        extra = {"tiny_dir": str(tiny_dir), "tiny_params": sum(p.numel() for p in tiny_model.parameters())}
    dist.barrier()
    import gc

    gc.freeze()  # keep gc.collect from walking torch's and transformers' objects every configuration
    results = []
    for config in json.loads(configs_json):
        start = time.time()
        results.append({"config": config, **_run_config(config, model_dir, world, rank),
                        "seconds": time.time() - start})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"results": results, **extra}))
    dist.barrier()
    dist.destroy_process_group()
    from stages import compat

    compat.remove_cpu_comm_buffer()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # ZeRO-3 processes occasionally abort in interpreter teardown (CONTEXT.md)


# --------------------------------------------------------------------------- tests


# The planner's byte model was read from, and is verified against, this DeepSpeed line.
DEEPSPEED_MODELLED = "0.19."


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("deepspeed")
    except PackageNotFoundError:
        pytest.skip("DeepSpeed is not installed")
    if not installed.startswith(DEEPSPEED_MODELLED):
        pytest.skip(f"the planner models DeepSpeed {DEEPSPEED_MODELLED}x allocations; this is {installed}")
    from stages.distributed import free_port

    folder = tmp_path_factory.mktemp("deepspeed-memory")
    model_dir = folder / "model"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))}
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun) if torchrun.exists() else sys.executable,
               *([] if torchrun.exists() else ["-m", "torch.distributed.run"]),
               "--nproc_per_node", str(WORLD), "--master_port", str(free_port()),
               __file__, "--worker", str(model_dir), str(folder), json.dumps(CONFIGS)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        pytest.fail(f"DeepSpeed workers failed ({result.returncode}):\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"model_dir": str(model_dir), "ranks": ranks}



def _result(measured: dict, rank: int, config: dict) -> dict:
    return next(r for r in measured["ranks"][rank]["results"] if r["config"] == config)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_model_states_match_deepspeed(measured, config):
    expected = estimated(config, measured["model_dir"])
    for rank in range(WORLD):
        result = _result(measured, rank, config)
        for point in ("backward", "step"):
            got, want = result[point], expected[point]
            assert got["other"] <= 0.01 * sum(got[c] for c in CATEGORIES), (
                f"unclassified DeepSpeed tensors at {point}: {got['other_paths']}")
            total_got = sum(got[c] for c in CATEGORIES)
            total_want = sum(want[c] for c in CATEGORIES)
            assert abs(total_want - total_got) <= TOLERANCE * total_got, (
                f"rank {rank} {point}: estimated {total_want:,} B, DeepSpeed holds {total_got:,} B "
                f"({got} vs {want})")
            for category in CATEGORIES:  # each item, not only the sum (small ones within 1% of the total)
                slack = max(TOLERANCE * got[category], 0.01 * total_got)
                assert abs(want[category] - got[category]) <= slack, (
                    f"rank {rank} {point} {category}: estimated {want[category]:,} B, DeepSpeed {got[category]:,} B")


@pytest.mark.slow
@pytest.mark.e2e
def test_builtin_tiny_llama_shape_is_what_stages_tiny_writes(measured):
    from core import shapes

    info = measured["ranks"][0]
    assert shapes.tiny_llama_shape().n_params == info["tiny_params"]
    assert shapes.resolve_shape(info["tiny_dir"]) == shapes.tiny_llama_shape()


def errors_table(measured: dict) -> list[tuple[str, str, float, float, float]]:
    """(config, moment, estimated MB, measured MB, error %) for rank 0: benchmarks/ records it."""
    rows = []
    for config in CONFIGS:
        expected = estimated(config, measured["model_dir"])
        result = _result(measured, 0, config)
        for point in ("backward", "step"):
            got = sum(result[point][c] for c in CATEGORIES)
            want = sum(expected[point][c] for c in CATEGORIES)
            rows.append((config_id(config), point, want / 1e6, got / 1e6, 100 * (want - got) / got))
    return rows


# --------------------------------------------------------------------------- gradient buckets of what trains

BUCKET_CONFIGS = [{"kind": kind, "precision": "bf16", "zero_stage": zero, "optimizer_offload": False, "lora": LORA}
                  for kind, zero in (("sft", 2), ("rm", 2), ("sft", 3))]


def _bucket_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for bucket in optimizer.ipg_buckets.values() for t in bucket.buffer)


def bucket_worker(model_dir: str, out_dir: str) -> None:
    """Each BUCKET_CONFIGS stage configured as the runner configures it (stages/runner.py
    trained_params into engine.deepspeed_config); the bytes of the gradient buckets DeepSpeed
    allocates: ZeRO-3 at initialisation, ZeRO-2 when the backward sets them up (released after it)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages import engine, models, runner

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(model_dir)
    dist.barrier()
    found = []
    for config in BUCKET_CONFIGS:
        models._live_ds_configs.clear()
        stage = stage_spec(config, model_dir)
        ds_config = engine.deepspeed_config(stage, world, MODEL["hidden_size"], False,
                                            runner.trained_params(stage, model_dir))
        if config["kind"] == "rm":
            model = models.load_reward_model(model_dir, stage, ds_config, on_gpu=False, pad_token_id=0)
        else:
            model = models.load_causal_lm(model_dir, stage, ds_config, on_gpu=False)
        ds = engine.initialize(model, stage, ds_config, total_steps=10)
        allocated = [_bucket_bytes(ds.optimizer)]
        if config["zero_stage"] < 3:
            setup = ds.optimizer.setup_buckets

            def recording_setup(setup=setup, allocated=allocated, ds=ds):
                setup()
                allocated.append(_bucket_bytes(ds.optimizer))

            ds.optimizer.setup_buckets = recording_setup
        ids = torch.randint(1, MODEL["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(rank))
        out = ds(input_ids=ids, attention_mask=torch.ones_like(ids)) if config["kind"] == "rm" else ds(
            input_ids=ids, labels=ids)
        ds.backward(out.logits.float().sum() if config["kind"] == "rm" else out.loss)
        ds.step()
        found.append({"config": config, "bucket_bytes": max(allocated),
                      "reduce_bucket_size": ds_config["zero_optimization"]["reduce_bucket_size"]})
        if hasattr(ds, "destroy"):
            ds.destroy()
    Path(out_dir, f"buckets{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
    from stages import compat

    compat.remove_cpu_comm_buffer()
    sys.stdout.flush()
    os._exit(0)


def test_lora_gradient_buckets_are_the_size_of_what_trains(tmp_path):
    """DeepSpeed allocates its gradient buckets whole, whatever fills them: a LoRA stage's are its
    adapters' size, not the 5e5 elements (5e8 on GPUs) a full model's get, and the plan says so."""
    from importlib.metadata import version

    if not version("deepspeed").startswith(DEEPSPEED_MODELLED):
        pytest.skip(f"the planner models DeepSpeed {DEEPSPEED_MODELLED}x allocations; this is {version('deepspeed')}")
    from core.deepspeed_settings import CPU_BUCKET_ELEMENTS
    from core.shapes import resolve_shape
    from pipeline import plan
    from pipeline.plan.memory import trainable_tensors
    from stages.distributed import free_port

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
               "--master_port", str(free_port()), __file__, "--buckets", str(tmp_path / "model"), str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    shape = resolve_shape(str(tmp_path / "model"))
    for found in json.loads((tmp_path / "buckets0.json").read_text()):
        stage = stage_spec(found["config"], str(tmp_path / "model"))
        knobs = plan.Knobs.from_stage(stage)
        hw = plan.Hardware(gpu=None, gpus_per_node=0, processes_per_node=WORLD, gpu_memory_bytes=None,
                           host_memory_bytes=None)
        memory = plan.estimate_memory(*plan.stage_models(knobs, shape), knobs, hw)
        planned = sum(i.bytes for i in memory.items if "gradient bucket" in i.name)
        trained = sum(trainable_tensors(plan.stage_models(knobs, shape)[0][0], knobs)[0])
        assert found["reduce_bucket_size"] == trained < CPU_BUCKET_ELEMENTS, found
        assert found["bucket_bytes"] == planned == 2 * trained, (found, planned)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(*sys.argv[2:5])
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--buckets":
    bucket_worker(*sys.argv[2:4])
