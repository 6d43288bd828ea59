"""Sampling completions from the actor: the one function an RL rollout calls to turn prompts into
responses, with transformers' two engines behind it (the third, vLLM, lives in
stages/vllm_engine.py and is called the same way; `engine_for` picks).

- padded: left-padded chunks of micro_rollout_batch_size. Every stack has it. A chunk runs until its
  longest completion ends; rows that finished early keep padding along. On a GPU where transformers
  has the cache for it (5.x: stages/compat.py static_decoding_unavailable) a chunk is decoded by this
  module's own loop on a static KV cache with a compiled fixed-shape step and no per-token wait for
  the device (`static_padded`); elsewhere by `generate` (`padded`; on the pinned 4.38 stack the
  static path would gain nothing, and the log says so once).
- continuous: transformers' continuous batching (`generate_batch`, transformers 5.x; whether the
  installed one has it is stages/compat.py's question). Prompts are requests over a paged KV cache;
  each leaves the running batch at its eos and a waiting one takes its place, with no padding.

`generation: auto` (the default) takes the engine AUTO_ENGINE names for the device, a decision
made by benchmarks/rl_generation.py's records (cited there; tests/test_generation.py holds the
table to them): padded on a CPU and on a GPU. On a CPU continuous batching was 3-20x slower for the
tiny chain (two gc.collect() and a thread join per call, and per-step scheduling in Python,
outweigh the padding it saves); on an H200 1.8-20x slower. Both records are of the tiny chain's
model, so per-step overhead, not a large model's decoding: no record yet says where (if anywhere)
continuous batching overtakes, and until one does auto stays padded for every model size.

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
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core import rollout_engine
from core.errors import InvalidInput
from stages import compat

# Most tokens one continuous-batching forward pass takes. Without flash attention (sdpa, eager) each
# pass builds an attention mask of this many rows by the whole cache: 2048 rows keep it near 300 MB
# for 16 sequences of 2304 tokens, and prefill still fits a whole prompt (see `continuous`).
STEP_TOKENS = 2048


@dataclass
class Sampled:
    """Completions of a call, in prompt order, and the sampler's log-prob of each of their tokens:
    where the sampler is another engine than the trainer (vLLM: stages/vllm_engine.py), for greedy
    completions none (None)."""

    ids: list[list[int]]
    logprobs: list[list[float]] | None = None


@dataclass(frozen=True)
class Decision:
    """What `generation: auto` picks on one kind of device, and the measurement it rests on."""

    engine: str
    records: tuple[str, ...]  # benchmarks/rl_generation.py's records (benchmarks/results/) it was decided by
    figures: str  # what they measured: best response tokens/s of sampled rollouts, padded vs continuous


AUTO_ENGINE = {
    "cpu": Decision("padded", ("benchmarks/results/rl-generation-cpu-2026-11-22.json",
                               "benchmarks/results/rl-generation-cpu-2026-11-22-long.json"),
                    "2 CPU cores, tiny chain's SFT policy: padded 30,029 vs continuous 1,497 tok/s (128 sequences, "
                    "8 new tokens); 11,907 vs 3,853 (512 sequences, up to 64 new)"),
    "cuda": Decision("padded", ("benchmarks/results/h200-2026-11-26/rlgen-short.json",
                                "benchmarks/results/h200-2026-11-26/rlgen-long.json"),
                     "one H200, tiny chain's SFT policy: padded 35,550 vs continuous 1,815 tok/s (128 sequences, "
                     "8 new tokens); 7,989 vs 4,511 (512 sequences, up to 64 new)"),
}


def engine_for(stage, module, device) -> str:
    """The engine `stage.generation` asks for on this stack and device (auto: see the module doc; on
    a GPU where vLLM is installed, vllm: stages/vllm_engine.py). Asking for continuous where the
    installed transformers has none, or for vllm where vLLM is not installed, is an error, not a fallback."""
    if stage.generation == "vllm" and rollout_engine.stack_problem():
        raise InvalidInput(f"stage '{stage.name}': {rollout_engine.stack_problem()}")
    if stage.generation == "auto" and torch.device(device).type == "cuda" and rollout_engine.gpu_build_installed():
        logging.getLogger("stages").info("generation: auto samples with vLLM (%s): %s", rollout_engine.installed(),
                                         rollout_engine.WHY_AUTO)
        return "vllm"
    available = compat.continuous_batching_available(module, stage.zero_stage)
    if stage.generation == "continuous" and not available:
        raise InvalidInput(f"stage '{stage.name}': generation: continuous needs transformers' continuous batching "
                           f"(5.x), which the installed transformers {compat.versions()['transformers']} does not "
                           f"have; use auto or padded")
    if stage.generation == "auto":
        decided = AUTO_ENGINE.get(torch.device(device).type, AUTO_ENGINE["cpu"]).engine
        return decided if decided == "padded" or available else "padded"
    return stage.generation


def generate(actor, prompts: Sequence, *, tokenizer, stage, device, greedy: bool = False,
             clock=None, decoding: str | None = None) -> list[list[int]]:
    """Response token ids for each prompt (objects with `.ids`, the prompt's token ids). Every process
    must call this as often as the others, with any number of prompts (ZeRO-3 gathers collectively).
    `clock` (stages/phases.py), if given, is told the seconds spent gathering and releasing the
    actor's ZeRO-3 weights as "gather_s". `decoding` ("static" or "dynamic") overrides
    padded_decoding's choice for the padded engine (tests: static on a CPU)."""
    module = actor.module
    module.eval()
    ids = [list(p.ids) for p in prompts]
    engine = engine_for(stage, module, device)
    static = engine == "padded" and (decoding or padded_decoding(device, stage.zero_stage)) == "static"
    if stage.zero_stage != 3:
        held = contextlib.nullcontext()
    else:
        # Continuous batching and the static loop run as many forwards as their own rows need (each
        # stops when they end): DeepSpeed's per-forward collectives could not follow, so its hooks are lifted.
        held = compat.zero3_unhooked(actor) if engine == "continuous" or static else _gathered(module)
    with torch.no_grad(), _timed(held, device, clock):
        if engine == "continuous":
            out = continuous(module, ids, tokenizer=tokenizer, stage=stage, greedy=greedy) if ids else []
        elif static:
            try:
                out = static_padded(module, ids, tokenizer=tokenizer, stage=stage, device=device, greedy=greedy,
                                    compiled=torch.device(device).type == "cuda")
            except Exception as err:  # noqa: BLE001 -- see _static_failed
                _static_failed(err)
                out = padded(module, ids, tokenizer=tokenizer, stage=stage, device=device, greedy=greedy)
        else:
            out = padded(module, ids, tokenizer=tokenizer, stage=stage, device=device, greedy=greedy)
    return [cut_at_eos(row, tokenizer.eos_token_id) for row in out]


@contextlib.contextmanager
def _timed(held, device, clock):
    """`held` entered and left, each timed into clock's "gather_s" (waiting for the device: the
    gather's collectives are queued on the GPU, not finished, when DeepSpeed returns)."""
    if clock is None or isinstance(held, contextlib.nullcontext):
        with held:
            yield
        return
    started = time.perf_counter()
    with held:
        _synchronize(device)
        clock.add("gather_s", time.perf_counter() - started)
        yield
        _synchronize(device)
        released = time.perf_counter()
    clock.add("gather_s", time.perf_counter() - released)


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _static_failed(err: Exception) -> None:
    """The compiled static-cache loop has been tested on CPU only (no GPU was lent to the session
    that wrote it): where it fails on a GPU (a compile error, a cache the model does not take), the
    stage says why, once, and decodes with `generate` on the same device for the rest of the run,
    rather than stop an RL stage over a faster path."""
    global _static_broken
    _static_broken = f"{type(err).__name__}: {err}"
    logging.getLogger("stages").warning(
        "static-cache decoding failed (%s); this stage decodes with generate from now on (the same GPU, "
        "slower). Please report it with this log", _static_broken, exc_info=True)


_static_broken: str | None = None  # why the static loop failed in this process, if it did


def padded_decoding(device, zero_stage: int) -> str:
    """How the padded engine decodes here: "static" (a static KV cache and a fixed-shape step,
    compiled; `static_padded`) on a GPU where transformers has the cache for it (and, under
    ZeRO-3, DeepSpeed can lift its hooks), else "dynamic" (`generate`). A CPU gains nothing from
    either the compile or the fixed shapes, and tests ask for static there by name."""
    if torch.device(device).type != "cuda" or _static_broken:
        return "dynamic"
    missing = compat.static_decoding_unavailable()
    if missing is None and zero_stage == 3 and not compat.zero3_hooks_liftable():
        missing = f"DeepSpeed {compat.versions()['deepspeed']} cannot lift its ZeRO-3 hooks for generation"
    if missing is not None:
        if missing not in _said:
            _said.add(missing)
            logging.getLogger("stages").info("padded generation without a static cache: %s", missing)
        return "dynamic"
    return "static"


_said: set[str] = set()


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


# The static decoder looks at whether every row of a chunk has ended only every this many steps: one
# wait for the device per CHECK_EVERY tokens instead of one per token, at the cost of up to
# CHECK_EVERY - 1 steps run after the last row ended.
CHECK_EVERY = 32
# The static cache's length is rounded up to a multiple of this, so that chunks of different prompt
# widths share a few shapes: each new shape costs the compiled step a compile (~1 minute on a CPU for
# the tiny model).
CACHE_ROUNDING = 256


def static_padded(module, prompts: list[list[int]], *, tokenizer, stage, device, greedy: bool,
                  compiled: bool) -> list[list[int]]:
    """The padded engine's chunks decoded by its own loop on a static KV cache (transformers' StaticCache):
    a prefill of the left-padded chunk, then one fixed-shape step per token (the whole cache's mask,
    one token per row; the cache's length rounded up to CACHE_ROUNDING), the token picked on the device;
    nothing comes back to the host but every CHECK_EVERY steps whether all rows have ended. `compiled`:
    the step goes through torch.compile
    (no CUDA graphs: under ZeRO-3 the gathered weights are new tensors at every call, which a
    captured graph would still point at). Greedy completions equal `padded`'s (tests/test_generation.py);
    samples are drawn from a generator seeded from torch's, one draw per chunk, so a resumed run
    (same random state) samples the same."""
    missing = compat.static_decoding_unavailable()
    if missing is not None:
        raise RuntimeError(f"static-cache decoding asked for, but {missing}")
    step = _compiled_step(module) if compiled else _decode_step
    responses = []
    for start in range(0, len(prompts), stage.micro_rollout_batch_size):
        chunk = prompts[start : start + stage.micro_rollout_batch_size]
        width, rows, new = max(len(p) for p in chunk), len(chunk), stage.max_new_tokens
        length = -(-(width + new) // CACHE_ROUNDING) * CACHE_ROUNDING
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.zeros(rows, length, dtype=torch.long, device=device)
        for i, p in enumerate(chunk):
            mask[i, width - len(p) : width] = 1
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        generator = None
        if not greedy:
            seed = int(torch.randint(0, 2**63 - 1, (1,)).item())
            generator = torch.Generator(device=device).manual_seed(seed)
        cache = compat.static_kv_cache(module, length)
        logits = module(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions, past_key_values=cache,
                        use_cache=True).logits[:, -1]
        position = positions[:, -1:] + 1
        out = torch.full((rows, new), tokenizer.pad_token_id, dtype=torch.long, device=device)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        for t in range(new):
            token = _pick(logits, stage, greedy, generator)
            token = torch.where(ended, tokenizer.pad_token_id, token)
            out[:, t] = token
            ended |= token == tokenizer.eos_token_id
            if t == new - 1 or ((t + 1) % CHECK_EVERY == 0 and bool(ended.all())):
                break
            mask[:, width + t] = 1
            logits = step(module, token[:, None], mask, position, cache)
            position = position + 1
        responses += out.tolist()
    return responses


def _decode_step(module, token, mask, position, cache):
    """One token per row on the static cache: fixed shapes whatever the step (the whole cache's mask)."""
    return module(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache,
                  use_cache=True).logits[:, -1]


_compiled_steps: dict = {}


def _compiled_step(module):
    """`_decode_step` through torch.compile, once per module (recompiled when a chunk's shapes change)."""
    key = id(module)
    if key not in _compiled_steps:
        _compiled_steps[key] = torch.compile(_decode_step, dynamic=False)
    return _compiled_steps[key]


def _pick(logits, stage, greedy: bool, generator):
    """The next token of each row: the most likely, or drawn as `generate` draws (temperature, then
    nucleus top_p; top_k off)."""
    if greedy:
        return logits.argmax(-1)
    logits = logits.float() / stage.temperature
    if stage.top_p < 1.0:
        ordered, order = logits.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        beyond = probs.cumsum(-1) - probs > stage.top_p  # the most likely token always stays
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered.masked_fill(beyond, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


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
            results: dict = {}
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
