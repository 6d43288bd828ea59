"""`python -m stages.self_check`: what the installed transformers / DeepSpeed need of stages/compat.py, checked.

It reports the installed versions and which patches apply; which DeepSpeed ops are prebuilt
(compiled in at install) or already JIT-built in the extensions folder (stages/deepspeed_ops.py),
which optimizer a GPU stage gets and whether it needs a build, and the TORCH_CUDA_ARCH_LIST
rewrite stage jobs would make. It then loads a tiny Llama in bf16 under ZeRO-3 (real DeepSpeed
in a one-process group; where DeepSpeed cannot start, e.g. DeepSpeed 0.13 without a GPU,
zero.Init-style constructors and the cast the installed DeepSpeed does) and checks that its
rotary cos/sin match an fp32 build. Exit code 0 when they do.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from stages import compat, pretrained
from stages.rotary_fp32 import rotary_cos_sin, rotary_signature, zero_init_style_constructors


def _report_deepspeed_ops() -> None:
    from deepspeed.accelerator import get_accelerator

    from core.schemas.sft import SFTStage
    from stages import deepspeed_ops, engine

    built, built_for = compat.prebuilt_ops()
    here = get_accelerator()._name  # what DeepSpeed's op loader compares with built_for
    usable = built if built_for in (None, here) else []
    where = f" for {built_for}" if built and built_for else ""
    unusable = (f"; not loaded here, where the accelerator is {here}: DeepSpeed JIT-builds them"
                if built and not usable else "")
    print(f"DeepSpeed ops prebuilt{where}: {', '.join(built) or 'none'}{unusable}")
    cached = deepspeed_ops.jit_built_ops()
    print(f"JIT-built extensions in {deepspeed_ops.extensions_dir()}: {', '.join(cached) or 'none'}")

    def status(op):
        if op in usable:
            return "prebuilt"
        return "JIT-built earlier, cached" if op in cached else "not built: compiled at the first step"

    choices = []
    for offload in (False, True):
        stage = SFTStage.model_validate({"name": "check", "kind": "sft", "model": "builtin:tiny-llama",
                                         "data": {"path": "builtin:digits"}, "optimizer_offload": offload})
        config = engine.deepspeed_config(stage, world_size=8, hidden_size=4096, on_gpu=True)
        op = compat.optimizer_op(config)
        params = config["optimizer"]["params"]
        choice = (f"torch.optim.AdamW(fused={params.get('fused', False)}), no build" if op is None
                  else f"DeepSpeed {op} ({status(op)})")
        choices.append(f"{'with' if offload else 'without'} optimizer_offload: {choice}")
    print("optimizer of a GPU stage: " + "; ".join(choices))
    before = os.environ.get(compat.ARCH_LIST)
    after = compat.deepspeed_arch_list(before)
    change = "left as it is" if after == before else f"stage jobs use {after!r}" if after else "stage jobs unset it"
    print(f"{compat.ARCH_LIST}: {'unset' if before is None else repr(before)}: {change}")


# --------------------------------------------------------------------------- self-check



def rotary_error_under_zero3(positions: int = 4096) -> tuple[float | None, str]:
    """(max |cos/sin difference|, how it was built) between a tiny Llama loaded in fp32 and
    the same loaded in bf16 under ZeRO-3 and wrapped by DeepSpeed's engine; (None, why)
    when there is nothing faithful to compare.

    Uses the real zero.Init in a one-process group where DeepSpeed can start here; where
    it cannot (DeepSpeed 0.13 without a GPU), zero.Init-style constructors around the
    model's construction and the engine's cast, as the installed DeepSpeed does it."""
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=positions)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        fp32 = compat.from_pretrained_kwargs(torch.float32, "eager")
        reference = AutoModelForCausalLM.from_pretrained(folder, **fp32)
        try:
            model, how = _load_under_real_zero3(AutoModelForCausalLM, folder, positions)
        except Exception as err:  # noqa: BLE001 - any failure to start DeepSpeed: emulate instead
            why = f"DeepSpeed could not start here: {type(err).__name__}: {str(err)[:160]}"
            if not compat.rotary_patch_needed()[0]:
                # Here transformers' own ZeRO-3 loading re-initialises the frequencies, which
                # the emulation does not reproduce: it would report an error that does not exist.
                return None, why
            model = _load_under_zero_init_style(AutoModelForCausalLM, LlamaForCausalLM, folder)
            how = f"zero.Init-style constructors ({why})"
    worst = 0.0
    for ref_module, module in zip(_rotaries(reference), _rotaries(model)):
        for want, got in zip(rotary_cos_sin(ref_module, positions), rotary_cos_sin(module, positions)):
            worst = max(worst, (want - got.cpu()).abs().max().item())
    return worst, how


def _load_under_real_zero3(auto_class, folder: str, positions: int):
    import deepspeed

    started_here = not torch.distributed.is_initialized()
    if started_here:
        from stages.distributed import free_port

        for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = torch.distributed.get_world_size()
    ds_config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world,
                 "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    live = compat.hf_deepspeed_config(ds_config)
    model, _ = pretrained.from_pretrained(auto_class, folder, torch.bfloat16, "eager", positions)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    del live
    if started_here:
        compat.remove_cpu_comm_buffer()  # a group of one: nobody else will open it
    return engine.module, f"deepspeed.zero.Init + deepspeed.initialize, DeepSpeed {compat.versions()['deepspeed']}"


def _load_under_zero_init_style(auto_class, model_class, folder: str):
    init = model_class.__init__

    @functools.wraps(init)
    def init_under_zero_init(self, *args, **kwargs):
        with zero_init_style_constructors(torch.bfloat16):
            init(self, *args, **kwargs)

    model_class.__init__ = init_under_zero_init
    try:
        model = auto_class.from_pretrained(folder, **compat.from_pretrained_kwargs(torch.bfloat16, "eager"))
    finally:
        model_class.__init__ = init
    if compat.deepspeed_casts_buffers():
        return model.bfloat16()
    for param in model.parameters():
        param.data = param.data.bfloat16()
    return model


def _rotaries(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def self_check() -> int:
    """Print versions, patches and the rotary check; 0 when every check passes."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    compat.prepare()
    print("versions:", "  ".join(f"{k} {v}" for k, v in compat.versions().items()))
    off = compat.disabled_patches()
    needed, reason = compat.rotary_patch_needed()
    state = "off (switched off)" if "rotary_fp32" in off else ("applies" if needed else "not needed")
    print(f"rotary_fp32: {state}: {reason}")
    for cls in compat.rotary_classes():
        print(f"  {cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}.forward{rotary_signature(cls)}")
    from transformers import LlamaConfig

    mask = pretrained.registers_square_causal_mask(LlamaConfig())
    state = "off (switched off)" if "causal_mask_cap" in off else ("applies" if mask else "not needed")
    print(f"causal_mask_cap: {state}: LlamaModel {'registers' if mask else 'does not register'} a "
          "(max_position_embeddings^2) causal_mask buffer")
    print("from_pretrained dtype argument:", next(iter(compat.from_pretrained_kwargs(torch.float32, "sdpa"))))
    _report_deepspeed_ops()

    error, how = rotary_error_under_zero3()
    if error is None:
        print(f"rotary cos/sin under ZeRO-3: not checked ({how}); rotary_fp32 does not apply here")
        return 0
    ok = error < 1e-5
    print(f"rotary cos/sin of a tiny Llama built in bf16 under ZeRO-3 vs fp32, positions 0-4095: "
          f"max |error| {error:.3g} ({'OK' if ok else 'FAILED: above 1e-5'}); built with {how}")
    return 0 if ok else 1


def main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(prog="python -m stages.self_check", description=__doc__.split("\n")[0]).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return self_check()


if __name__ == "__main__":
    raise SystemExit(main())
