"""The RL group (issue 27, item 5): a GRPO step on one GPU, the project's stage as a user runs it.

The actor is the shared workload's random-init model (benchmarks/gpu/workload.py) with its end
of sequence made likely, so that completions end with lengths like real RL's instead of running
to the cap: `config.mlp_bias` on, the last layer's MLP adds a fixed vector u*|r| (|r|: the
residual stream's typical norm) at every position, and the EOS row of the output embedding
points along u, scaled so that EOS has EOS_PROBABILITY per step on average over the prompts'
positions (calibrated once from one forward pass: the scale changes no other logit). Lengths are
then roughly geometric, mean ~1/EOS_PROBABILITY, capped at MAX_NEW_TOKENS. Any stack that loads
a Llama with mlp_bias (transformers >= 4.41) samples the same lengths from it: the project's stage
(project-grpo) and TRL's GRPOTrainer with its transformers generation (trl-grpo, no vLLM) both do.

Prompts: RL_PROMPTS rows of lognormal length around PROMPT_MEDIAN words; reward: the built-in
`length` rule (a rule reward, no reward model, no label). GRPO, SAMPLES_PER_PROMPT samples per
prompt, no KL term (TRL's GRPO default, beta 0), one optimizer step per rollout, ROLLOUTS
rollouts, the first left out of the figures (it compiles the static-cache decode step).

From the stage's metrics.jsonl (one record per rollout): seconds per rollout and per phase,
generated tokens/s, its share of the memory-bandwidth limit, the GPU's busy share per phase,
the mean completion length. From TRL: each optimizer step's wall time (one per generation batch,
as the project's rollout), and the time and completion tokens of its `_generate`, timed around.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.cases import catalogue_gpu, nvidia_smi, read_json, read_jsonl
from core.runfolder import StageFolder

REPO = Path(__file__).resolve().parents[2]
PIPELINE_NAME = "bench-rl"
EOS_PROBABILITY = 1 / 300
MAX_NEW_TOKENS = 1024
SAMPLES_PER_PROMPT = 8
PROMPTS_PER_ROLLOUT = 16  # x 8 samples: 128 sequences, decoded together (micro_rollout_batch_size)
ROLLOUTS = 4
RL_PROMPTS = 128
PROMPT_MEDIAN = 100
SEED = 4321
# The rollout figures each record has (stages/ppo.py rollout_record), averaged over the measured rollouts.
FIGURES = ("rollout_s", "generate_s", "gather_s", "score_s", "offload_s", "train_s", "other_s",
           "generate_tokens_per_s", "generate_bandwidth_fraction", "gpu_busy_generate", "gpu_busy_score",
           "gpu_busy_train", "gpu_busy_rollout", "response_length")


def settings_of(settings: dict) -> dict:
    """The RL knobs (what the table shows); on a CPU (the dry run) a short cap keeps it quick."""
    cpu = settings["device"] != "cuda"
    return {"samples_per_prompt": SAMPLES_PER_PROMPT, "prompts_per_rollout": PROMPTS_PER_ROLLOUT,
            "max_new_tokens": 16 if cpu else MAX_NEW_TOKENS, "eos_probability": 1 / 8 if cpu else EOS_PROBABILITY,
            "rollouts": 2 if cpu else ROLLOUTS, "prompt_median": 8 if cpu else PROMPT_MEDIAN}


# --------------------------------------------------------------------------- the workload


def prompt_rows(count: int, vocab: int, median: int, seed: int, longest: int = 10**6) -> list[dict]:
    """Prompts of lognormal length around `median` words, at most `longest`."""
    from benchmarks.gpu.workload import LENGTH_SIGMA, SPECIALS, _words

    rng, n_words = random.Random(seed), vocab - len(SPECIALS)
    lengths = [min(longest, max(1, round(rng.lognormvariate(math.log(median), LENGTH_SIGMA)))) for _ in range(count)]
    return [{"prompt": _words(rng, n_words, n) + " "} for n in lengths]


def eos_model(source: Path, folder: Path, eos_probability: float, device: str) -> dict:
    """`source` with its end of sequence made likely (see the module doc), saved in its own dtype
    to `folder`; returns what was set."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, mlp_bias=True, dtype="auto").to(device).eval()
    for name, parameter in model.named_parameters():
        if ".mlp." in name and name.endswith("_proj.bias"):  # not in the checkpoint: start at 0
            torch.nn.init.zeros_(parameter)
    rows = prompt_rows(8, model.config.vocab_size, 32, SEED + 1)
    batch = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True).to(device)
    real = batch.attention_mask.bool()
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda module, args, out: seen.update(into=args[0], out=out))
    eos, head = tokenizer.eos_token_id, model.get_output_embeddings().weight
    with torch.no_grad():
        model(**batch)
        residual = seen["into"][real].float().norm(dim=-1).median().item()  # the stream's typical norm
        direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(SEED))
        direction = (direction / direction.norm()).to(device)
        model.model.layers[-1].mlp.down_proj.bias.copy_(direction * residual)
        head[eos] = 0.0
        logits = model(**batch).logits[real].float()
        others = torch.logsumexp(torch.cat([logits[:, :eos], logits[:, eos + 1:]], dim=-1), dim=-1)
        along = seen["out"][real].float() @ direction.float()  # EOS's logit is scale x this
        # The mean EOS probability over the positions grows with the scale: bisect for the target.
        low, high = 0.0, 1.0
        while torch.sigmoid(high * along - others).mean() < eos_probability and high < 1e6:
            low, high = high, high * 2
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if torch.sigmoid(mid * along - others).mean() < eos_probability else (low, mid)
        head[eos] = (direction * high).to(head.dtype)
    hook.remove()
    folder.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"eos_scale": high, "residual_norm": residual, "eos_probability": eos_probability}


# --------------------------------------------------------------------------- the case body


def pipeline_spec(settings: dict, knobs: dict, model: Path, prompts: Path, runs_dir: Path, gpu) -> dict:
    cluster = {"executor": "local", "time": "0:30:00"}
    cluster.update({"gpus_per_node": 1, **({"gpu": gpu} if gpu else {})} if settings["device"] == "cuda"
                   else {"tasks_per_node": 1})
    sequences = knobs["prompts_per_rollout"] * knobs["samples_per_prompt"]
    return {
        "name": PIPELINE_NAME, "runs_dir": str(runs_dir), "cluster": cluster,
        "stages": [{
            "name": "grpo", "kind": "ppo", "model": str(model), "data": {"path": str(prompts)},
            "precision": settings["precision"], "attention": "sdpa", "zero_stage": settings["zero_stage"],
            "gradient_checkpointing": True, "max_len": settings["max_len"],
            "max_new_tokens": knobs["max_new_tokens"], "n_samples_per_prompt": knobs["samples_per_prompt"],
            "rollout_batch_size": knobs["prompts_per_rollout"], "micro_rollout_batch_size": sequences,
            "micro_batch_size": settings["micro_batch_size"], "global_batch_size": sequences,
            "advantage": "grpo", "kl_coef": 0, "reward": {"rules": [{"rule": "length"}]},
            "learning_rate": settings["learning_rate"], "warmup_steps": 0, "max_steps": knobs["rollouts"],
            "log_interval": 1, "save_interval": 0, "eval_prompts": 8,
        }],
    }


def actor(settings: dict, info: dict, knobs: dict) -> tuple[Path, dict]:
    """The EOS-raised actor both stacks sample from, built once per workload folder in a process of
    its own (a CUDA context left in the case's process would hold GPU memory beside what it measures)."""
    model = Path(info["folder"]) / f"model-eos-{round(1 / knobs['eos_probability'])}"
    marker = model / "eos.json"
    if not marker.is_file():
        made = subprocess.run([sys.executable, "-m", "benchmarks.gpu.rl", info["model"], str(model),
                               str(knobs["eos_probability"]), settings["device"]],
                              cwd=REPO, capture_output=True, text=True)
        print(made.stdout + made.stderr, flush=True)
        if made.returncode != 0:
            raise SystemExit(1)
        marker.write_text(made.stdout.strip().splitlines()[-1] + "\n")
    return model, json.loads(marker.read_text())


def prompts_file(work: Path, settings: dict, info: dict, knobs: dict) -> Path:
    path = work / "prompts.jsonl"
    rows = prompt_rows(RL_PROMPTS, _vocab(info), knobs["prompt_median"], SEED,
                       longest=settings["max_len"] - knobs["max_new_tokens"] - 2)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(case, work: Path, settings: dict, info: dict) -> None:
    knobs = settings_of(settings)
    model, eos = actor(settings, info, knobs)
    prompts = prompts_file(work, settings, info, knobs)
    if case.params["stack"] == "trl":
        return run_trl(work, settings, knobs, model, eos, prompts)
    import yaml

    gpu = settings.get("gpu") or (catalogue_gpu(nvidia_smi("name")) if settings["device"] == "cuda" else None)
    runs_dir = work / "runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    config = work / "pipeline.yaml"
    config.write_text("# written by benchmarks/gpu/rl.py\n"
                      + yaml.safe_dump(pipeline_spec(settings, knobs, model, prompts, runs_dir, gpu), sort_keys=False))
    (work / "facts.json").write_text(json.dumps({"settings": knobs, "catalogue_gpu": gpu, "eos": eos}, indent=2) + "\n")
    done = subprocess.run([sys.executable, "-m", "pipeline", "run", str(config), "--force"], cwd=REPO)
    shutil.rmtree(StageFolder.of(runs_dir / PIPELINE_NAME, "grpo").model, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(1)


def length_reward(completions, **_) -> list[float]:
    """The project's built-in `length` rule (core/rewards.py length_penalty, target 100), as TRL calls a reward."""
    from core.rewards import length_penalty

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return length_penalty([], texts, [])


def trl_config(work: Path, settings: dict, knobs: dict) -> dict:
    """GRPOConfig's fields: the project case's settings in TRL's names (one optimizer step per
    generation batch of 16 prompts x 8 samples, no KL term, DAPO's loss: both stacks' defaults)."""
    on_gpu = settings["device"] == "cuda"
    sequences = knobs["prompts_per_rollout"] * knobs["samples_per_prompt"]
    micro = settings["micro_batch_size"]
    return dict(
        output_dir=str(work / "trainer"), max_steps=knobs["rollouts"], learning_rate=settings["learning_rate"],
        lr_scheduler_type="constant", warmup_steps=0, per_device_train_batch_size=micro,
        gradient_accumulation_steps=sequences // micro, generation_batch_size=sequences,
        num_generations=knobs["samples_per_prompt"], max_completion_length=knobs["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="dapo", use_vllm=False,
        bf16=settings["precision"] == "bf16", use_cpu=not on_gpu, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=42,
    )


def run_trl(work: Path, settings: dict, knobs: dict, model: Path, eos: dict, prompts: Path) -> None:
    """TRL's GRPOTrainer with its transformers generation on the same actor and prompts; steps.jsonl:
    per optimizer step its wall seconds, the seconds and completion tokens of its generation."""
    facts = {"settings": knobs, "eos": eos}
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        facts["skipped"] = f"trl cannot be imported here: {err}"
        (work / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")
        return
    import time

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    on_gpu = settings["device"] == "cuda"
    fields = trl_config(work, settings, knobs)
    facts.update(versions={"trl": trl.__version__}, config=fields,
                 catalogue_gpu=catalogue_gpu(torch.cuda.get_device_name()) if on_gpu else None)
    (work / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")
    log = work / "steps.jsonl"
    log.unlink(missing_ok=True)

    def now() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    timing = {"generate_s": 0.0, "tokens": 0, "started": None}

    class Measured(GRPOTrainer):
        def _generate(self, prompts):
            started = now()
            out = super()._generate(prompts)
            timing["generate_s"] += now() - started
            completions = out[1]  # (prompt_ids, completion_ids, ...): completion ids, cut after eos
            timing["tokens"] += sum(len(c) for c in completions)
            return out

    class StepLog(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if timing["started"] is None:
                timing["started"] = now()

        def on_step_end(self, args, state, control, **kwargs):
            end = now()
            with open(log, "a") as f:
                f.write(json.dumps({"step": state.global_step, "step_s": end - timing["started"],
                                    "generate_s": timing["generate_s"], "completion_tokens": timing["tokens"]}) + "\n")
            timing.update(generate_s=0.0, tokens=0, started=end)

    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = Dataset.from_list(read_jsonl(prompts))
    trainer = Measured(model=str(model), reward_funcs=length_reward, args=GRPOConfig(**fields), train_dataset=dataset,
                       processing_class=tokenizer, callbacks=[StepLog()])
    trainer.train()
    facts["finished"] = True
    (work / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")


def _decoding_limit(gpu, info, settings: dict, sequences: int):
    """core/hardware.py's ceiling for the actor decoded `sequences` at once; None without a catalogued GPU."""
    if not gpu or not info:
        return None
    from core import hardware
    from core.shapes import read_config_json

    weight_bytes = read_config_json(Path(info["model"]) / "config.json").n_params * (
        4 if settings["precision"] == "fp32" else 2)
    return hardware.decoding_tokens_per_s_limit(hardware.gpu(gpu), weight_bytes, sequences)


def _vocab(info: dict) -> int:
    return json.loads((Path(info["model"]) / "config.json").read_text())["vocab_size"]


# --------------------------------------------------------------------------- collect (torch-free)


def collect(case, work: Path, settings: dict, info) -> dict:
    facts = read_json(work / "facts.json") or {}
    stack = case.params["stack"]
    out = {"stack": stack, "settings": facts.get("settings") or settings_of(settings),
           "catalogue_gpu": facts.get("catalogue_gpu"), "eos": facts.get("eos")}
    if facts.get("skipped"):
        return {**out, "skipped": facts["skipped"], "complete": False}
    if stack == "trl":
        steps = read_jsonl(work / "steps.jsonl")
        measured = steps[1:] or steps  # the first step warms up, as the project's first rollout does
        sequences = out["settings"]["prompts_per_rollout"] * out["settings"]["samples_per_prompt"]
        rows = [{"rollout_s": s["step_s"], "generate_s": s["generate_s"],
                 "generate_tokens_per_s": s["completion_tokens"] / s["generate_s"] if s["generate_s"] else None,
                 "response_length": s["completion_tokens"] / sequences} for s in measured]
        out.update(complete=bool(facts.get("finished")), rollouts_done=len(steps), rollouts_measured=len(measured),
                   first_rollout_s=steps[0]["step_s"] if steps else None)
        limit = _decoding_limit(out["catalogue_gpu"], info, settings, sequences)
        for row in rows:  # the project's stage logs its own; TRL's is worked out the same way
            row["generate_bandwidth_fraction"] = (row["generate_tokens_per_s"] / limit
                                                  if limit and row["generate_tokens_per_s"] else None)
    else:
        stage = StageFolder.of(work / "runs" / PIPELINE_NAME, "grpo")
        rollouts = [r for r in read_jsonl(stage.metrics) if "rollout" in r]
        rows = rollouts[1:] or rollouts  # the first compiles the decode step
        out.update(complete=stage.result.is_file(), rollouts_done=len(rollouts), rollouts_measured=len(rows),
                   first_rollout_s=rollouts[0]["rollout_s"] if rollouts else None)
    for key in FIGURES:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None  # null: not measured (e.g. no GPU, or not TRL's)
    return out


if __name__ == "__main__":  # python -m benchmarks.gpu.rl SOURCE FOLDER EOS_PROBABILITY DEVICE
    print(json.dumps(eos_model(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4])))
