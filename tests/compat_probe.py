"""Loads a tiny Llama through the project's model loader under real DeepSpeed ZeRO-3 in a
process of its own (one rank, gloo) and prints one JSON line of measurements.
tests/test_compat.py runs it, with and without the compat patches (POST_TRAIN_COMPAT_OFF).

    python tests/compat_probe.py rotary FOLDER          cos/sin vs an fp32 build
    python tests/compat_probe.py train-step FOLDER      forward, one ZeRO-3 step, export, reload
    python tests/compat_probe.py positions FOLDER       memory of a ZeRO-3 build, under an
                                                        address-space limit (--limit-gib)
    python tests/compat_probe.py release FOLDER         what outlives a released frozen model,
                                                        ZeRO-2 and ZeRO-3
    python tests/compat_probe.py static-zero3 FOLDER    greedy completions of a ZeRO-3 actor, static-cache
                                                        loop (hooks lifted) vs generate (gathered)
    python tests/compat_probe.py weights FOLDER         each model folder in FOLDER loaded as a causal LM
                                                        and as a reward model under ZeRO-3: the class
                                                        built, or the refusal
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import tempfile
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from core.errors import InvalidInput  # noqa: E402
from core.schemas.sft import SFTStage  # noqa: E402
from stages import compat, distributed, engine, export, models, rotary_fp32  # noqa: E402


def stage(max_len: int, precision: str = "bf16") -> SFTStage:
    return SFTStage.model_validate({
        "name": "probe", "kind": "sft", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
        "zero_stage": 3, "precision": precision, "max_len": max_len, "attention": "eager", "learning_rate": 1e-2,
    })


def load(folder: str, spec: SFTStage):
    ds_config = engine.deepspeed_config(spec, world_size=1, hidden_size=64, on_gpu=False)
    return models.load_causal_lm(folder, spec, ds_config, on_gpu=False), ds_config


def rotary(folder: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    positions = AutoConfig.from_pretrained(folder).max_position_embeddings
    # Before any ZeRO-3 config is alive: this one is built the ordinary way.
    reference = AutoModelForCausalLM.from_pretrained(folder, **compat.from_pretrained_kwargs(torch.float32, "eager"))
    spec = stage(max_len=positions)
    model, ds_config = load(folder, spec)
    ds = engine.initialize(model, spec, ds_config, total_steps=1)
    pairs = list(zip(rotaries(reference), rotaries(ds.module)))
    worst = 0.0
    for want_module, got_module in pairs:
        wanted, got_back = (rotary_fp32.rotary_cos_sin(m, positions) for m in (want_module, got_module))
        for want, got in zip(wanted, got_back):
            worst = max(worst, (want - got).abs().max().item())
    return {"max_error": worst, "rotary_modules": len(pairs), "positions": positions,
            "signature": rotary_fp32.rotary_signature(type(pairs[0][1]))}


def rotaries(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def train_step(folder: str) -> dict:
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = stage(max_len=32)
    model, ds_config = load(folder, spec)
    ds = engine.initialize(model, spec, ds_config, total_steps=1)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 2] * 3])
    first = dict(ds.module.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    with deepspeed.zero.GatheredParameters([first]):
        before = first.detach().float().clone()
    ds.train()
    loss = ds(input_ids=ids, labels=ids).loss
    ds.backward(loss)
    ds.step()
    with deepspeed.zero.GatheredParameters([first]):
        changed = (first.detach().float() - before).abs().max().item()
    out = Path(tempfile.mkdtemp(prefix="compat-export-"))
    export.export(ds, models.load_tokenizer(folder), spec, out / "model", is_main=True)
    models._live_ds_configs.clear()  # ZeRO-3 off again: reload with plain transformers
    exported = AutoModelForCausalLM.from_pretrained(out / "model")
    with torch.no_grad():
        logits = exported(input_ids=ids).logits
    return {
        "loss": loss.item(),
        "param_dtype": str(first.dtype),
        "weight_change": changed,
        "loaded_max_position_embeddings": ds.module.config.max_position_embeddings,
        "exported_max_position_embeddings": AutoConfig.from_pretrained(out / "model").max_position_embeddings,
        "source_max_position_embeddings": AutoConfig.from_pretrained(folder).max_position_embeddings,
        "exported_logits_finite": bool(torch.isfinite(logits).all()),
    }


def positions(folder: str, limit_gib: float) -> dict:
    """Peak resident memory added by loading under ZeRO-3, and the model's buffer bytes.
    The address-space limit makes an attempt at a huge allocation fail at once."""
    spec = stage(max_len=64)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_kib("VmSize") * 1024 + int(limit_gib * 2**30), hard))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    rss_before = _vm_kib("VmRSS")
    model, _ = load(folder, spec)
    peak_growth = (_vm_kib("VmHWM") - rss_before) * 1024
    return {
        "peak_rss_growth_bytes": peak_growth,
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "max_position_embeddings_built": model.config.max_position_embeddings,
    }


def release(folder: str) -> dict:
    """What is still alive of a frozen model, consulted once as the DPO precompute does, after
    `FrozenModel.release()`: a plain module under ZeRO-2, a DeepSpeed engine under ZeRO-3."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 2]])
    alive = {}
    for zero_stage in (2, 3):  # ZeRO-2 first: while a ZeRO-3 config lives, models load sharded
        spec = stage(max_len=32).model_copy(update={"zero_stage": zero_stage})
        config = engine.frozen_model_config(spec, world_size=1, hidden_size=64, on_gpu=False, offload=False)
        frozen = models.load_frozen(AutoModelForCausalLM, folder, spec, config, torch.device("cpu"), offload=False)
        for _ in range(3):  # ZeRO-3 caches what each submodule releases once its first pass is traced
            frozen(input_ids=ids)
        parameter = next(frozen.module.parameters())
        held = {"model": weakref.ref(frozen.module), "parameter": weakref.ref(parameter)}
        if frozen.engine is not None:
            held["engine"] = weakref.ref(frozen.engine)
            held["partition"] = weakref.ref(parameter.ds_tensor)
        del parameter
        frozen.release()
        alive[f"zero{zero_stage}"] = sorted(name for name, ref in held.items() if ref() is not None)
    return alive


def weights(folder: str) -> dict:
    """What the loader makes of the weights of each model folder in `folder` under ZeRO-3, loaded as
    a causal LM and as a reward model (stages/loaded_weights.py)."""
    spec = stage(max_len=32)
    ds_config = engine.deepspeed_config(spec, world_size=1, hidden_size=64, on_gpu=False)
    loads = {"causal_lm": lambda path: models.load_causal_lm(path, spec, ds_config, on_gpu=False),
             "reward_model": lambda path: models.load_reward_model(path, spec, ds_config, on_gpu=False, pad_token_id=0)}
    found = {}
    for model in sorted(Path(folder).iterdir()):
        found[model.name] = {}
        for kind, load_it in loads.items():
            try:
                found[model.name][kind] = type(load_it(str(model))).__name__
            except InvalidInput as err:
                found[model.name][kind] = err.message
    return found


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def static_zero3(folder: str) -> dict:
    """Greedy completions of the actor as an RL stage holds it (a ZeRO-3 engine, fp32) through
    stages/generation.py both ways, each gathering (and timing) as the stage does."""
    from types import SimpleNamespace

    from stages import generation, phases
    from tests.test_ppo import ppo_spec

    spec = stage(max_len=48, precision="fp32")
    model, ds_config = load(folder, spec)
    ds = engine.initialize(model, spec, ds_config, total_steps=1)
    tokenizer = models.load_tokenizer(folder)
    prompts = [SimpleNamespace(ids=tokenizer(f"s: sort {digits} =\na: ")["input_ids"])
               for digits in ("3", "41", "592", "6535", "89793", "238462", "6433832", "79502884", "1")]
    rl = ppo_spec(zero_stage=3, generation="padded", micro_rollout_batch_size=4, max_new_tokens=8)
    out, gathered = {}, {}
    for decoding in ("static", "dynamic"):
        clock = phases.Clock()
        out[decoding] = generation.generate(ds, prompts, tokenizer=tokenizer, stage=rl, device=torch.device("cpu"),
                                            greedy=True, clock=clock, decoding=decoding)
        gathered[decoding] = clock.take()[0].get("gather_s", 0.0)
    return {"static": out["static"], "dynamic": out["dynamic"], "gather_s": gathered}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["rotary", "train-step", "positions", "release", "static-zero3",
                                                         "weights"])
    parser.add_argument("folder")
    parser.add_argument("--limit-gib", type=float, default=4.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    distributed.init(distributed.detect(), gpus_per_node=0)  # on the CPU
    if args.scenario == "rotary":
        result = rotary(args.folder)
    elif args.scenario == "train-step":
        result = train_step(args.folder)
    elif args.scenario == "positions":
        result = positions(args.folder, args.limit_gib)
    elif args.scenario == "static-zero3":
        result = static_zero3(args.folder)
    elif args.scenario == "weights":
        result = weights(args.folder)
    else:
        result = release(args.folder)
    print("PROBE " + json.dumps(result), flush=True)
    distributed.shutdown()
    compat.remove_cpu_comm_buffer()
    # ZeRO-3's threads sometimes abort the interpreter's own teardown; the result is out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
