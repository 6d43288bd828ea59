"""The GPU benchmark: the project's SFT and DPO stages against TRL on one GPU.

benchmarks/gpu_bench.py is the command; these modules are its parts:
  workload.py   model shapes, the random-init model and word-level tokenizer, synthetic data
  runner.py     each case in its own subprocess with a timeout, a total budget, the summary
  cases.py      the case list and the cases that need neither the project nor TRL (env, matmul)
  project.py    the project's stages as cases: a pipeline file, `plan --json`, `run`, metrics.jsonl
  hf_trl.py     TRL's SFTTrainer and DPOTrainer as cases, measured by a callback
  report.py     the case JSONs -> RESULTS.md tables
Everything but the case bodies is torch-free, so `report` runs anywhere.
"""
