"""TRL's SFTTrainer and DPOTrainer as benchmark cases, each with the options TRL offers to go fast.

Same model folder, same rows, same tokens (see workload.py), same precision
class, same rows per optimizer step, same gradient checkpointing as the project's
case of the same kind; no evaluation, no saving. Variants (case params):
  trl-sft           defaults: padded batches of 4 rows, 8 accumulated (32 rows a step)
  trl-sft-padfree   padding_free=True: the 4 rows flattened into one sequence; data are
                    already within max_len, so max_length=None (TRL refuses padding_free
                    with a max_length it would not enforce)
  trl-sft-packed    packing=True, packing_strategy="bfd" (implies padding-free): 4 packs
                    of up to max_len tokens per micro batch (the project's token budget), as
                    many accumulated as hold the tokens of 32 average rows (2 for the 1B shape)
  trl-sft-liger     the packed variant plus use_liger_kernel=True (skipped when
                    liger_kernel is not installed, or on a CPU)
  trl-dpo           defaults: 4 pairs (8 sequences) per micro batch, 8 accumulated, live reference
  trl-dpo-liger     plus use_liger_kernel=True
  trl-dpo-padfree   padding_free=True, measured only if the trainer keeps it on (TRL 1.16
                    turns it off with a warning and pads; the case then says so, untrained)
Everything runs with completion-only loss (prompt tokens masked) like the project,
learning rate, betas and clipping as the project's stage, TRL's own precision
default (fp32 weights and optimizer, bf16 autocast: what DeepSpeed's bf16 mode
keeps too), attn_implementation sdpa, TRL's default optimizer.

Measurement: a Trainer subclass counts, in every micro batch it trains on, the
real tokens (input_ids != <pad>: prompt and response of every sequence, chosen
and rejected both), the processed tokens (tensor elements) and the sequences; a
callback closes each optimizer step with a CUDA synchronise, and writes one line
per step to steps.jsonl at once (a case killed mid-way keeps its steps): wall
seconds, those counts, torch.cuda.max_memory_allocated / max_memory_reserved
(since the process started).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from benchmarks.gpu.cases import catalogue_gpu, datasheet_tflops, gradient_checkpointing, read_json, read_jsonl
from benchmarks.gpu.workload import model_flops_per_token

GiB = 1024**3


def trainer_settings(case, settings: dict, info: dict) -> dict:
    p = case.params
    packed = bool(p.get("packing"))
    accumulation = settings["global_batch_size"] // settings["micro_batch_size"]
    if packed:
        # A step of as many packs of max_len tokens as hold global_batch_size average rows (1B
        # shape: 8 packs of 2048 ~ 32 rows of ~530), micro_batch_size packs a micro batch: the
        # tokens per pass the project's packing holds (micro_batch_size x max_len).
        mean = info["data"][p["trainer"]]["mean_tokens"]
        packs = max(1, round(settings["global_batch_size"] * mean / settings["max_len"]))
        accumulation = max(1, round(packs / settings["micro_batch_size"]))
    return {
        "trainer": p["trainer"],
        "gradient_checkpointing": gradient_checkpointing(p["trainer"], settings["gradient_checkpointing"]),
        "per_device_train_batch_size": settings["micro_batch_size"],
        "gradient_accumulation_steps": accumulation,
        "packing": packed,
        "padding_free": bool(p.get("padding_free")),
        "liger": bool(p.get("liger")),
        "max_steps": settings["steps"],
        "data": p["trainer"],
    }


def config_fields(knobs: dict, settings: dict, work: Path) -> dict:
    """The SFTConfig / DPOConfig arguments (recorded with the result)."""
    on_gpu = settings["device"] == "cuda"
    fields = dict(
        output_dir=str(work / "trainer"),
        max_steps=knobs["max_steps"],
        per_device_train_batch_size=knobs["per_device_train_batch_size"],
        gradient_accumulation_steps=knobs["gradient_accumulation_steps"],
        learning_rate=settings["learning_rate"],
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        bf16=settings["precision"] == "bf16",
        fp16=False,
        use_cpu=not on_gpu,
        gradient_checkpointing=knobs["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        use_liger_kernel=knobs["liger"],
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=2 if on_gpu else 0,
        seed=42,
        padding_free=knobs["padding_free"],
    )
    if knobs["trainer"] == "sft":
        fields.update(
            completion_only_loss=True,
            packing=knobs["packing"],
            packing_strategy="bfd",
            # padding-free without packing does not truncate, and says so unless max_length is None;
            # every row is within max_len already
            max_length=None if knobs["padding_free"] and not knobs["packing"] else settings["max_len"],
        )
    else:
        fields.update(max_length=settings["max_len"], beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=False)
    return fields


# --------------------------------------------------------------------------- the case body


def run(case, work: Path, settings: dict, info: dict) -> None:
    knobs = trainer_settings(case, settings, info)
    facts = {"settings": knobs}
    on_gpu = settings["device"] == "cuda"
    reason = _missing(knobs, on_gpu)
    if reason:
        _write_facts(work, {**facts, "skipped": reason})
        return

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        gpu = settings.get("gpu") or catalogue_gpu(props.name)
        facts.update(device_name=props.name, catalogue_gpu=gpu)
    facts["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__}
    fields = config_fields(knobs, settings, work)
    facts["config"] = fields
    _write_facts(work, facts)

    tokenizer = AutoTokenizer.from_pretrained(info["model"])
    rows = read_jsonl(Path(info["data"][knobs["data"]]["path"]))
    if knobs["trainer"] == "sft":
        from trl import SFTConfig as Config
        from trl import SFTTrainer as Trainer

        dataset = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows])
    else:
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer

        dataset = Dataset.from_list(rows)

    log = _step_log(work / "steps.jsonl", tokenizer.pad_token_id, on_gpu)
    trainer = _measured(Trainer, log)(model=info["model"], args=Config(**fields), train_dataset=dataset,
                                      processing_class=tokenizer, callbacks=[log])
    facts["resolved"] = {
        "padding_free": getattr(trainer, "padding_free", None),
        "completion_only_loss": getattr(trainer, "completion_only_loss", None),
        "optim": str(trainer.args.optim),
        "model_dtype": str(trainer.model.dtype),
        "attn_implementation": trainer.model.config._attn_implementation,
        "reference_model": type(getattr(trainer, "ref_model", None)).__name__ if knobs["trainer"] == "dpo" else None,
    }
    if knobs["padding_free"] and not trainer.padding_free:
        facts["skipped"] = (f"TRL {trl.__version__}'s {Trainer.__name__} turns padding_free off (it warns and pads "
                            "as the defaults do): nothing different to measure")
        _write_facts(work, facts)
        return
    _write_facts(work, facts)
    trainer.train()
    facts["finished"] = True
    if on_gpu:
        facts["final_gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
    _write_facts(work, facts)


def _missing(knobs: dict, on_gpu: bool):
    """Why the case cannot run here, or None."""
    if importlib.util.find_spec("trl") is None:
        return "trl is not installed"
    try:  # trl imports lazily: its trainers are where a missing dependency shows
        from trl import DPOTrainer, SFTTrainer  # noqa: F401
    except ImportError as err:
        return f"trl is installed but cannot be imported here: {err}"
    if knobs["liger"]:
        if not on_gpu:
            return "Liger's Triton kernels need a GPU"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed"
    return None


def _measured(trainer_class, log):
    """trainer_class, counting the tokens of every micro batch it trains on."""

    class Measured(trainer_class):
        def training_step(self, model, inputs, *args, **kwargs):
            log.count(inputs)
            return super().training_step(model, inputs, *args, **kwargs)

    Measured.__name__ = trainer_class.__name__
    return Measured


def _step_log(path: Path, pad_id: int, cuda: bool):
    """The callback that writes steps.jsonl (a TrainerCallback: built here, as transformers is imported
    only in the case's own process)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        """Per optimizer step: wall seconds, real/processed tokens, sequences, peak GPU memory."""

        def __init__(self, path: Path, pad_id: int, cuda: bool):
            self.path, self.pad_id, self.cuda = path, pad_id, cuda
            self.counts, self.started = None, None

        def count(self, inputs) -> None:
            import torch

            ids = inputs["input_ids"]
            if inputs.get("attention_mask") is not None:
                sequences = (inputs["attention_mask"].sum(-1) > 0).sum()
            elif inputs.get("position_ids") is not None:  # padding-free: a sequence starts at position 0
                sequences = (inputs["position_ids"] == 0).sum()
            else:
                sequences = torch.tensor(ids.shape[0], device=ids.device)
            counts = torch.stack([(ids != self.pad_id).sum(), torch.tensor(ids.numel(), device=ids.device),
                                  sequences.to(ids.device)])
            self.counts = counts if self.counts is None else self.counts + counts  # no sync until the step ends

        def _now(self) -> float:
            if self.cuda:
                import torch

                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            now = self._now()
            real, processed, sequences = self.counts.tolist() if self.counts is not None else (0, 0, 0)
            record = {"step": state.global_step, "step_s": now - self.started, "real_tokens": real,
                      "processed_tokens": processed, "sequences": sequences}
            if self.cuda:
                import torch

                record["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
                record["gpu_mem_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.counts, self.started = None, self._now()

    return StepLog(path, pad_id, cuda)


def _write_facts(work: Path, facts: dict) -> None:
    (work / "facts.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------- collect (torch-free)


def collect(case, work: Path, settings: dict, info: dict) -> dict:
    facts = read_json(work / "facts.json") or {}
    knobs = facts.get("settings") or trainer_settings(case, settings, info)
    out = {"stack": "trl", "settings": knobs, "config": facts.get("config"), "resolved": facts.get("resolved"),
           "catalogue_gpu": facts.get("catalogue_gpu"), "versions": facts.get("versions")}
    if facts.get("skipped"):
        return {**out, "skipped": facts["skipped"], "complete": False}
    steps = read_jsonl(work / "steps.jsonl")
    measured = [s for s in steps if s["step"] > settings["warmup_steps"]]
    seconds = sum(s["step_s"] for s in measured)
    real = sum(s["real_tokens"] for s in measured)
    processed = sum(s["processed_tokens"] for s in measured)
    out.update(
        complete=bool(facts.get("finished")),
        steps_done=max((s["step"] for s in steps), default=0),
        steps_measured=len(measured),
        tokens_per_s=real / seconds if seconds else None,
        padding_share=1 - real / processed if processed else None,
        step_s=seconds / len(measured) if measured else None,
        sequences_per_step=sum(s["sequences"] for s in measured) / len(measured) if measured else None,
        gpu_mem_peak_gib=max((s["gpu_mem_peak_gib"] for s in steps if "gpu_mem_peak_gib" in s), default=None),
        gpu_mem_reserved_gib=max((s["gpu_mem_reserved_gib"] for s in steps if "gpu_mem_reserved_gib" in s),
                                 default=None),
    )
    flops = model_flops_per_token(info, knobs["data"], live_reference=knobs["trainer"] == "dpo") if info else None
    peak = datasheet_tflops(out["catalogue_gpu"], settings["precision"])
    out.update(model_flops_per_token=flops, datasheet_tflops=peak,
               mfu=out["tokens_per_s"] * flops / (peak * 1e12) if out["tokens_per_s"] and flops and peak else None)
    return out
