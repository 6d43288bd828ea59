"""vLLM as an RL stage's rollout engine (`generation: vllm`): one engine in each process of the
stage, in its own job, beside the DeepSpeed engines that train (core/rollout_engine.py).

- Layout: vLLM's `external_launcher` runs the engine inside the stage's processes and on their
  torch.distributed group (gloo on a CPU, NCCL on GPUs). `vllm.tensor_parallel` N consecutive
  ranks (one node's) hold one engine's weights, 1/N each; they sample their prompts together (each
  hands the others its prompts and seeds, all run the same requests, each keeps its own).
- Weights: the engine starts from the stage's starting model, and `sync` hands it the actor's
  weights by name (vLLM's `reload_weights`, which cuts each whole tensor to this process's
  tensor-parallel share) after every actor update, and whenever the actor has stepped since the
  last sync (a resumed run). Under ZeRO-3 they are gathered one module at a time, never the whole
  model at once; LoRA adapters are merged into their layers' weights for the hand-over.
- Sampling: every request carries its own seed, drawn from the process's torch generator (one
  draw per call): the samples do not depend on how vLLM batches requests, and a resumed run (the
  same random state) samples what the interrupted one would have. The engine's own seeding at
  construction is kept away from the stage's random state. Prefix caching is off: a prompt's
  cached keys and values could differ in rounding from recomputed ones, and a resumed engine
  starts with an empty cache (it costs the n samples of a prompt their shared prefill).
- Log-probs: vLLM returns each sampled token's log-prob after temperature (`processed_logprobs`),
  what the trainer computes for the same token; stages/rollout.py compares them and corrects the
  loss (truncated importance sampling, stages/policy_losses.py).
- Sleep (`vllm.sleep`, GPU only): after sampling the engine releases its weights and KV cache
  (vLLM's sleep level 2); the next sync brings the weights back, the next call the cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from core import rollout_engine
from core.errors import InvalidInput
from stages import watchdog
from stages.checkpoints import rng_states, set_rng_states
from stages.generation import Sampled, cut_at_eos

log = logging.getLogger("stages")

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class VllmEngine:
    """This process's vLLM engine. Called like stages/generation.py `generate` (RolloutMaker's
    generate_fn); every process calls it as often as the others."""

    def __init__(self, stage, ctx, model_path: str):
        problem = rollout_engine.stack_problem()
        if problem:
            raise InvalidInput(f"stage '{stage.name}': {problem}")
        self.stage, self.on_gpu = stage, ctx.on_gpu
        n = stage.vllm.tensor_parallel
        self.group = _tensor_parallel_group(ctx.rank, ctx.world_size, n)
        self.synced_step: int | None = None  # the actor's optimizer steps at the last sync
        self.sleeping = False
        self.sync_bytes = 0  # handed over at the last sync, by this process
        started = time.perf_counter()
        with _random_state_kept():
            self.llm = _build(stage, ctx, model_path)
        log.info("vLLM engine (%s, tensor_parallel %d) built in %.1f s", rollout_engine.installed(), n,
                 time.perf_counter() - started)

    # ---- sampling

    def __call__(self, actor, prompts: Sequence, *, tokenizer, stage, device, greedy: bool = False,
                 clock=None) -> Sampled:
        from vllm import SamplingParams

        self.sync_if_stale(actor)
        self._wake("kv_cache")
        seed = None if greedy else int(torch.randint(0, 2**31 - 1, (1,)).item())
        mine = [(list(p.ids), None if seed is None else seed + i) for i, p in enumerate(prompts)]
        everyone = self._gathered(mine)
        requests = [{"prompt_token_ids": ids} for part in everyone for ids, _ in part]
        params = [SamplingParams(max_tokens=stage.max_new_tokens, temperature=0.0 if greedy else stage.temperature,
                                 top_p=1.0 if greedy else stage.top_p, seed=request_seed,
                                 logprobs=None if greedy else 0, detokenize=False)
                  for part in everyone for _, request_seed in part]
        outputs = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        first = sum(len(part) for part in everyone[: self._position()])
        own = [o.outputs[0] for o in outputs[first : first + len(mine)]]
        if self.on_gpu and stage.vllm.sleep:
            self._sleep()
        ids = [cut_at_eos(list(o.token_ids), tokenizer.eos_token_id) for o in own]
        if greedy:
            return Sampled(ids)
        return Sampled(ids, [[_sampled_logprob(step, token) for step, token in zip(o.logprobs, row)]
                             for o, row in zip(own, ids)])

    def _gathered(self, mine: list) -> list[list]:
        """Every process of this engine's group's requests, in rank order."""
        if self.group is None:
            return [mine]
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        return everyone

    def _position(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    # ---- weights

    def sync_if_stale(self, actor) -> None:
        """Sync unless the engine already holds the actor's weights of its current step."""
        if self.synced_step != actor.global_steps:
            self.sync(actor)

    def sync(self, actor) -> None:
        """Hand the actor's weights to the engine by name (every process: ZeRO-3 gathers
        collectively); `sync_bytes` says how many this process handed over."""
        self._wake("weights")
        started = time.perf_counter()
        counted = _Counted(named_weights(actor.module, self.stage.zero_stage == 3))
        worker = self.llm.llm_engine.model_executor.driver_worker.worker
        worker.reload_weights(weights_iterator=counted)
        self.llm.reset_prefix_cache()
        self.synced_step, self.sync_bytes = actor.global_steps, counted.bytes
        log.debug("vLLM weights synced: %d bytes in %.2f s", counted.bytes, time.perf_counter() - started)

    def _sleep(self) -> None:
        # Level 2 drops the weights (the next sync rewrites them) and the KV cache.
        self.llm.sleep(level=2)
        self.sleeping, self.synced_step = True, None

    def _wake(self, tags: str) -> None:
        if self.sleeping:
            self.llm.wake_up(tags=[tags])
            self.sleeping = tags == "weights"  # the KV cache is still asleep until the next call


@watchdog.phase(watchdog.LOADING)
def _build(stage, ctx, model_path: str):
    # The engine runs in this process, on the stage's process group: no engine process of its own.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoConfig
    from vllm import LLM

    config = AutoConfig.from_pretrained(model_path)
    longest = min(stage.max_len + stage.max_new_tokens, getattr(config, "max_position_embeddings", 1 << 30))
    settings = dict(model=model_path, tokenizer=model_path, skip_tokenizer_init=True, dtype=DTYPES[stage.precision],
                    tensor_parallel_size=stage.vllm.tensor_parallel, seed=stage.seed, max_model_len=longest,
                    logprobs_mode="processed_logprobs", enable_prefix_caching=False)
    if ctx.world_size > 1:
        settings["distributed_executor_backend"] = "external_launcher"
    if ctx.on_gpu:
        settings.update(gpu_memory_utilization=stage.vllm.gpu_memory_utilization,
                        enable_sleep_mode=stage.vllm.sleep)
    else:
        _job_own_shared_memory()
        # On a CPU vLLM reads gpu_memory_utilization as a share of host memory, which processes
        # sharing a machine cannot spare: the cache holds the sequences the stage decodes at once.
        sequences = stage.micro_rollout_batch_size * stage.vllm.tensor_parallel
        settings.update(enforce_eager=True, kv_cache_memory_bytes=rollout_engine.kv_cache_bytes(
            _kv_shape(config), sequences, longest, 4 if stage.precision == "fp32" else 2, stage.vllm.tensor_parallel))
    return LLM(**settings)


def _job_own_shared_memory() -> None:
    """vLLM's CPU all-reduce names its shared-memory segments after the group's ranks and the
    rendezvous method alone (`//-tp:0-[0-1]-cpushm` under external_launcher's env://), so two jobs
    on one machine, or a job after one that crashed, would open the same segments (errno 17,
    EEXIST): the names carry this job's own token instead (rank 0's process id and the rendezvous
    port, the same on every rank)."""
    from vllm.distributed.device_communicators import cpu_communicator

    token = [f"{os.getpid()}-{os.environ.get('MASTER_PORT', '')}"] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(token, src=0)

    def job_group_name(communicator) -> str:
        ranks = "-".join(str(rank) for rank in communicator.ranks)
        return f"post-train-{token[0]}-{communicator.unique_name}-[{ranks}]-cpushm"

    cpu_communicator._CPUSHMDistributed.make_group_name = staticmethod(job_group_name)


def _kv_shape(config) -> rollout_engine.KvShape:
    heads = config.num_attention_heads
    return rollout_engine.KvShape(layers=config.num_hidden_layers,
                                  kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                                  head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads)


def _tensor_parallel_group(rank: int, world: int, n: int):
    """This process's group of n consecutive ranks (vLLM's own tensor-parallel grouping), or None
    where it samples alone. Every process makes every group, as torch.distributed asks."""
    if n == 1:
        return None
    mine = None
    for first in range(0, world, n):
        group = dist.new_group(list(range(first, first + n)))
        if first <= rank < first + n:
            mine = group
    return mine


@contextlib.contextmanager
def _random_state_kept():
    """vLLM seeds python's, numpy's and torch's generators when it builds an engine: the stage's
    own random state (per rank, checkpointed) is put back."""
    states = rng_states()
    try:
        yield
    finally:
        set_rng_states(states)


def _sampled_logprob(step: dict, token: int) -> float:
    return float(step[token].logprob)


# --------------------------------------------------------------------------- weights by name


class _Counted:
    """An iterator of (name, tensor) that counts the bytes it hands over."""

    def __init__(self, weights: Iterator):
        self.weights, self.bytes = weights, 0

    def __iter__(self):
        for name, tensor in self.weights:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def named_weights(model, zero3: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under their Hugging Face names, one module at a time: under ZeRO-3 each
    module's parameters are gathered while its tensors are handed over (a copy, so that nothing
    points into a gathered buffer once it is released), then released. A peft model's LoRA layers
    hand over their merged weight (base + scale x B A) under the base layer's name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    merged: list[str] = []
    for prefix, module in base.named_modules():
        if any(prefix.startswith(m + ".") for m in merged):
            continue  # inside a LoRA layer, handed over merged
        lora = hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")
        params = list(module.parameters(recurse=lora))
        if not params:
            continue
        with _gathered(params, zero3):
            if lora:
                merged.append(prefix)
                yield from _merged_lora(prefix, module)
            else:
                for name, param in module.named_parameters(recurse=False):
                    yield _joined(prefix, name), param.detach().clone() if zero3 else param.detach()


def _merged_lora(prefix: str, module) -> Iterator[tuple[str, torch.Tensor]]:
    weight = module.base_layer.weight.detach()
    for adapter in module.active_adapters:
        if adapter in module.lora_A:
            weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
    yield _joined(prefix, "weight"), weight
    if getattr(module.base_layer, "bias", None) is not None:
        yield _joined(prefix, "bias"), module.base_layer.bias.detach().clone()


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _gathered(params, zero3: bool):
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)
