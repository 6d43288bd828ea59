"""The DeepSpeed step of the packed SFT on repeating shapes, timed and profiled (the diagnostic
behind benchmarks/RESULTS.md of 2026-11-22). Run on a GPU machine from the repository root: `python3 benchmarks/results/h100-2026-11-22/diag_step.py 2`,
`... 0`, `... 1`, `... --profile`, one process each (engines are not freed in between)."""
import math
import os
import random
import sys
import time

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="29517")
import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from pipeline.config import SFTStage  # noqa: E402
from stages import compat, data, engine  # noqa: E402
from stages.losses import token_logprobs  # noqa: E402

deepspeed.init_distributed(dist_backend="nccl")
torch.cuda.set_device(0)
cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                  max_position_embeddings=2048, attn_implementation="sdpa")
rng = random.Random(0)


def rows(budget):
    out, total = [], 0
    while True:
        length = max(16, min(2048, int(rng.lognormvariate(math.log(400), 0.8))))
        if total + length > budget:
            return out
        p = max(1, length // 4)
        out.append({"input_ids": [rng.randrange(100, 128000) for _ in range(length)],
                    "loss_mask": [0] * p + [1] * (length - p)})
        total += length


batches = [data.packed_batch(rows(8192), 0, 2048).to("cuda") for _ in range(2)]
tokens = sum(b.real_tokens for b in batches)


def sync():
    torch.cuda.synchronize()
    return time.time()


for zero in [int(z) for z in sys.argv[1:] if z.isdigit()]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    compat.install_packing_hooks(model)
    stage = SFTStage.model_validate({"name": "s", "kind": "sft", "model": "x", "data": {"path": "x.jsonl"},
                                     "zero_stage": zero, "micro_batch_size": 4, "global_batch_size": 8,
                                     "precision": "bf16"})
    config = engine.deepspeed_config(stage, 1, 2048, on_gpu=True)
    ds = engine.initialize(model, stage, config, 100)
    times = []
    for it in range(4):
        t0 = sync()
        fb = bw = st = 0.0
        for j, batch in enumerate(batches):
            ds.set_gradient_accumulation_boundary(j == len(batches) - 1)
            a = sync()
            with batch.apart():
                loss = -token_logprobs(batch.forward(ds).logits, batch.input_ids, batch.loss_mask).sum() / tokens
                b = sync()
                ds.backward(loss, scale_wrt_gas=False)
            c = sync()
            ds.step()
            d = sync()
            fb, bw, st = fb + b - a, bw + c - b, st + d - c
        times.append((sync() - t0, fb, bw, st))
    total, fb, bw, st = times[-1]
    print(f"zero {zero}: step {total * 1000:.0f} ms  forward+loss {fb * 1000:.0f}  backward {bw * 1000:.0f}  "
          f"step() calls {st * 1000:.0f}  ({tokens} tokens, {tokens / total:.0f} tok/s)", flush=True)

if "--profile" not in sys.argv:
    sys.exit(0)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
compat.install_packing_hooks(model)
stage = SFTStage.model_validate({"name": "s", "kind": "sft", "model": "x", "data": {"path": "x.jsonl"},
                                 "zero_stage": 2, "micro_batch_size": 4, "global_batch_size": 8, "precision": "bf16"})
ds = engine.initialize(model, stage, engine.deepspeed_config(stage, 1, 2048, on_gpu=True), 100)
del batches[2:]
for warm in range(2):
    for j, batch in enumerate(batches):
        ds.set_gradient_accumulation_boundary(j == 1)
        with batch.apart():
            ds.backward(-token_logprobs(batch.forward(ds).logits, batch.input_ids, batch.loss_mask).sum() / tokens,
                        scale_wrt_gas=False)
        ds.step()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for j, batch in enumerate(batches):
        ds.set_gradient_accumulation_boundary(j == 1)
        with batch.apart():
            ds.backward(-token_logprobs(batch.forward(ds).logits, batch.input_ids, batch.loss_mask).sum() / tokens,
                        scale_wrt_gas=False)
        ds.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
