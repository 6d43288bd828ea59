"""Export: a trained model written to model/ in Hugging Face format, LoRA merged unless kept,
atomically; ZeRO-3 weights gathered one parameter at a time so no GPU holds the whole model."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from core.failure import saving
from core.runfolder import temporary
from stages import pretrained, watchdog


def gather_state_dict(module, is_main: bool) -> dict | None:
    """Full weights on rank 0 (CPU), one parameter at a time so ZeRO-3 never holds the
    whole model on a GPU; None on the other ranks."""
    import deepspeed

    state = {}
    for name, param in module.named_parameters():
        sharded = hasattr(param, "ds_id")
        context = (deepspeed.zero.GatheredParameters([param], modifier_rank=None) if sharded
                   else contextlib.nullcontext())
        with context:
            if is_main:
                state[name] = param.detach().to("cpu", copy=True)
    saved = module.state_dict().keys() if is_main else ()  # the buffers a state dict holds (persistent ones)
    for name, buffer in module.named_buffers():
        if name in saved:
            state[name] = buffer.detach().to("cpu", copy=True)
    return state if is_main else None


def merge_lora_state_dict(state: dict, scaling: float, adapter: str = "default") -> dict:
    """peft-named weights -> plain model weights with W + scaling * B @ A folded in.

    `base_model.model.` prefixes and `.base_layer` infixes are dropped, and a
    module trained in full next to the adapters (modules_to_save) replaces the
    original.
    """
    out: dict = {}
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name or ".original_module." in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        plain = plain.replace(f".modules_to_save.{adapter}.", ".")
        if name.endswith(".base_layer.weight"):
            stem = name.removesuffix(".base_layer.weight")
            a = state[f"{stem}.lora_A.{adapter}.weight"].float()
            b = state[f"{stem}.lora_B.{adapter}.weight"].float()
            tensor = (tensor.float() + scaling * (b @ a)).to(tensor.dtype)
        out[plain] = tensor
    return out


@watchdog.phase(watchdog.EXPORT)
def export(engine, tokenizer, stage, out_dir: Path, is_main: bool, extra_files: dict | None = None) -> None:
    """Write model/ in Hugging Face format (LoRA merged unless kept), atomically."""
    module = engine.module
    if engine.zero_optimization_stage() == 3:
        # An evaluation forward (no backward) leaves parameters prefetched for the training
        # trace in flight; gathering one of them then fails with "Cannot partition a param in
        # flight" (ZeRO-3 on an H100, after the final evaluation). Settle them first.
        engine.empty_partition_cache()
    state = gather_state_dict(module, is_main)
    if is_main:
        assert state is not None, "gather_state_dict gives the main process the whole state"
        tmp = temporary(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        is_peft = hasattr(module, "peft_config")
        with saving(tmp, "the exported model"):
            # The config as the model came, not as loading adapted it (e.g. positions capped).
            with pretrained.exported_config(module):
                if is_peft and stage.lora.merge:
                    base = module.get_base_model()
                    merged = merge_lora_state_dict(state, stage.lora.alpha / stage.lora.rank)
                    base.save_pretrained(tmp, state_dict=merged)
                else:
                    module.save_pretrained(tmp, state_dict=state)
            tokenizer.save_pretrained(tmp)
            for name, content in (extra_files or {}).items():
                (tmp / name).write_text(json.dumps(content, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    dist.barrier()
