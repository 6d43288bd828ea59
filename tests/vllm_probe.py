"""The vLLM rollout engine (stages/vllm_engine.py) beside a ZeRO-3 actor in two processes (gloo),
tensor_parallel 2, as an RL stage holds them; tests/test_vllm_engine.py runs it once with torchrun
and asserts on what each rank writes.

    torchrun --nproc_per_node 2 tests/vllm_probe.py MODEL_FOLDER OUT_DIR
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(model: str, out: Path) -> None:
    import deepspeed
    import torch

    from core.schemas.ppo import PPOStage
    from stages import generation, models
    from stages.vllm_engine import VllmEngine
    from tests.test_generation import prompts

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=600))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(rank)
    stage = PPOStage.model_validate({
        "name": "rl", "kind": "ppo", "model": model, "data": {"path": "builtin:digits"}, "precision": "fp32",
        "zero_stage": 3, "max_len": 48, "max_new_tokens": 8, "micro_rollout_batch_size": 8, "generation": "vllm",
        "vllm": {"tensor_parallel": 2}, "reward": {"rules": [{"rule": "exact_match"}]}})
    tokenizer = models.load_tokenizer(model)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                 "zero_allow_untested_optimizer": True}
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    live = HfDeepSpeedConfig(ds_config)  # noqa: F841 -- ZeRO-3 loading while it lives
    actor, *_ = deepspeed.initialize(model=AutoModelForCausalLM.from_pretrained(model), config=ds_config)
    batch = prompts(tokenizer, 6, seed=3 + rank)  # each process its own prompts
    padded = stage.model_copy(update={"generation": "padded"})  # transformers' generate, the reference

    def hf_greedy():
        return generation.generate(actor, batch, tokenizer=tokenizer, stage=padded, device="cpu", greedy=True)

    state_before = torch.get_rng_state()
    engine = VllmEngine(stage, SimpleNamespace(rank=rank, world_size=world, on_gpu=False), model)
    record = {"random_state_kept": bool(torch.equal(state_before, torch.get_rng_state()))}
    call = dict(tokenizer=tokenizer, stage=stage, device="cpu")
    record["greedy"] = engine(actor, batch, greedy=True, **call).ids
    record["hf_greedy"] = hf_greedy()
    record["first_sync_bytes"] = engine.sync_bytes

    # Sampled: the same torch state samples the same; the sampler's log-probs against the trainer's.
    torch.manual_seed(100 + rank)
    sampled = engine(actor, batch, **call)
    torch.manual_seed(100 + rank)
    record["sampled_again_equal"] = engine(actor, batch, **call).ids == sampled.ids
    record["logprob_gap"] = logprob_gap(actor, batch, sampled, tokenizer)

    # The actor learns (one optimizer step away from its greedy answers); without a sync the
    # engine still holds the old weights, with one the new.
    take_a_step(actor, batch, record["hf_greedy"], tokenizer)
    record["hf_greedy_after_step"] = hf_greedy()
    engine.synced_step = actor.global_steps  # as if synced: the sync skipped
    record["greedy_without_sync"] = engine(actor, batch, greedy=True, **call).ids
    engine.sync(actor)
    record["greedy_after_sync"] = engine(actor, batch, greedy=True, **call).ids
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    torch.distributed.barrier()


def logprob_gap(actor, batch, sampled, tokenizer) -> float:
    """Largest |trainer - vLLM| log-prob over the sampled tokens (temperature 1)."""
    import torch

    worst = 0.0
    with torch.no_grad():
        for prompt, ids, logprobs in zip(batch, sampled.ids, sampled.logprobs):
            tokens = torch.tensor([list(prompt.ids) + ids])
            trainer = actor.module(input_ids=tokens).logits[0, len(prompt.ids) - 1 : -1].log_softmax(-1)
            picked = trainer.gather(-1, torch.tensor(ids)[:, None])[:, 0]
            worst = max(worst, (picked - torch.tensor(logprobs)).abs().max().item())
    return worst


def take_a_step(actor, batch, answers, tokenizer) -> None:
    """One SGD step that makes the actor's greedy answers less likely (lr 1: far enough to change them)."""
    import torch

    actor.train()
    for prompt, ids in zip(batch[:1], answers[:1]):
        tokens = torch.tensor([list(prompt.ids) + ids])
        logits = actor(input_ids=tokens).logits[0, len(prompt.ids) - 1 : -1]
        loss = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).mean()  # maximising it unlearns
        actor.backward(loss)
        actor.step()
    actor.eval()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
