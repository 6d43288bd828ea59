"""Sampling completions from the actor: the one function an RL rollout calls to turn prompts into
responses, with two engines behind it.

- padded: left-padded `generate` in chunks of micro_rollout_batch_size. Every stack has it. A chunk
  runs until its longest completion ends; rows that finished early keep padding along.
- continuous: transformers' continuous batching (`generate_batch`, transformers 5.x; whether the
  installed one has it is stages/compat.py's question). Prompts are requests over a paged KV cache;
  each leaves the running batch at its eos and a waiting one takes its place, with no padding.

`generation: auto` (the default) picks continuous where it exists and the actor is on a GPU, padded
on a CPU: on a CPU continuous batching was 3-20x slower for the tiny chain (two gc.collect() and a
thread join per call, and per-step scheduling in Python, outweigh the padding it saves;
benchmarks/RESULTS.md). The GPU half of the choice is the engine's design, not yet measured here.

Both engines return, in prompt order, each response's token ids cut after the first eos, at most
max_new_tokens. Greedy output is the same from both (tests/test_generation.py). Sampled output is
not: the engines draw their random numbers in different orders, which is why `generation` is in the
stage's spec hash. Both are deterministic given the process's torch random state, so a resumed run
samples what the interrupted one would have: continuous batching reseeds torch's global generator
with the seed it is given plus the process's rank, and that seed is drawn from the same generator.

Under ZeRO-3 the actor's parameters are gathered once around the whole call; for continuous
batching DeepSpeed's per-module hooks are lifted too (stages/compat.py zero3_unhooked: each process
runs its own number of forward passes, which the hooks' collective calls cannot follow).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Sequence

import torch

from core.errors import InvalidInput
from stages import compat

# Most tokens one continuous-batching forward pass takes. Without flash attention (sdpa, eager) each
# pass builds an attention mask of this many rows by the whole cache: 2048 rows keep it near 300 MB
# for 16 sequences of 2304 tokens, and prefill still fits a whole prompt (see `continuous`).
STEP_TOKENS = 2048


def engine_for(stage, module, device) -> str:
    """The engine `stage.generation` asks for on this stack and device (auto: see the module doc).
    Asking for continuous where the installed transformers has none is an error, not a fallback."""
    available = compat.continuous_batching_available(module, stage.zero_stage)
    if stage.generation == "continuous" and not available:
        raise InvalidInput(f"stage '{stage.name}': generation: continuous needs transformers' continuous batching "
                           f"(5.x), which the installed transformers {compat.versions()['transformers']} does not "
                           f"have; use auto or padded")
    if stage.generation == "auto":
        return "continuous" if available and torch.device(device).type == "cuda" else "padded"
    return stage.generation


def generate(actor, prompts: Sequence, *, tokenizer, stage, device, greedy: bool = False) -> list[list[int]]:
    """Response token ids for each prompt (objects with `.ids`, the prompt's token ids). Every process
    must call this as often as the others, with any number of prompts (ZeRO-3 gathers collectively)."""
    module = actor.module
    module.eval()
    ids = [list(p.ids) for p in prompts]
    if engine_for(stage, module, device) == "continuous":
        with torch.no_grad(), (compat.zero3_unhooked(actor) if stage.zero_stage == 3 else contextlib.nullcontext()):
            out = continuous(module, ids, tokenizer=tokenizer, stage=stage, greedy=greedy) if ids else []
    else:
        with torch.no_grad(), (_gathered(module) if stage.zero_stage == 3 else contextlib.nullcontext()):
            out = padded(module, ids, tokenizer=tokenizer, stage=stage, device=device, greedy=greedy)
    return [cut_at_eos(row, tokenizer.eos_token_id) for row in out]


def cut_at_eos(row: list[int], eos_id) -> list[int]:
    return row[: row.index(eos_id) + 1] if eos_id in row else row


def padded(module, prompts: list[list[int]], *, tokenizer, stage, device, greedy: bool) -> list[list[int]]:
    """`generate` on left-padded chunks of micro_rollout_batch_size prompts."""
    sampling = {} if greedy else {"temperature": stage.temperature, "top_p": stage.top_p, "top_k": 0}
    responses = []
    for start in range(0, len(prompts), stage.micro_rollout_batch_size):
        chunk = prompts[start : start + stage.micro_rollout_batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = module.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=stage.max_new_tokens,
            do_sample=not greedy, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            use_cache=True, **sampling,
        )
        responses += out[:, width:].tolist()
    return responses


def continuous(module, prompts: list[list[int]], *, tokenizer, stage, greedy: bool) -> list[list[int]]:
    """transformers' continuous batching over all the prompts at once.

    The KV cache holds micro_rollout_batch_size whole sequences (longest prompt + max_new_tokens), the
    memory one chunk of the padded engine takes, instead of the share of free GPU memory
    transformers would size it from (the models being trained live there too). It is built and freed
    on every call, and no CUDA graphs are captured: under ZeRO-3 the gathered parameters are new
    tensors every time, which a kept graph would still point at.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # not a line per call in the stage log

    page = 256  # transformers' default page size
    longest = max(len(p) for p in prompts) + stage.max_new_tokens
    in_flight = min(stage.micro_rollout_batch_size, len(prompts))
    config = ContinuousBatchingConfig(
        page_size=page, num_blocks=in_flight * -(-longest // page),
        max_batch_tokens=max(min(in_flight * longest, STEP_TOKENS), longest),
        max_requests_per_batch=in_flight, use_cuda_graph=False, use_async_batching=False,
        auto_switch_to_flash=False,  # the stage's attention setting stands
        seed=None if greedy else int(torch.randint(0, 2**31 - 1, (1,)).item()))
    sampling = ({"do_sample": False} if greedy else
                {"do_sample": True, "temperature": stage.temperature, "top_p": stage.top_p, "top_k": 0})
    generation_config = GenerationConfig(max_new_tokens=stage.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, **sampling)
    # Greedy draws nothing, but the manager reseeds torch's generator all the same: put it back.
    devices = [module.device] if module.device.type == "cuda" else []
    keep_rng = torch.random.fork_rng(devices=devices) if greedy else contextlib.nullcontext()
    with keep_rng:
        manager = module.init_continuous_batching(generation_config=generation_config,
                                                  continuous_batching_config=config)
        try:
            # Every request queued before the loop starts, so its batches (and the order of its random
            # draws) do not depend on thread timing: the same seed gives the same samples.
            request_ids = manager.add_requests(inputs=prompts, max_new_tokens=stage.max_new_tokens)
            manager.start()
            results = {}
            while len(results) < len(request_ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    break
        finally:
            manager.stop(block=True)
            manager.destroy()
    failed = [r.error for r in results.values() if r.error is not None]
    if len(results) != len(prompts) or failed:
        raise RuntimeError(f"continuous batching returned {len(results)} of {len(prompts)} completions"
                           + (f"; first error: {failed[0]}" if failed else "") + " (generation: padded avoids it)")
    return [list(results[request_id].generated_tokens) for request_id in request_ids]


def _gathered(module):
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()))
