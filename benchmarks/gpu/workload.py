"""What every case trains on: a random-init model of a named shape, a word-level
tokenizer, and synthetic rows with a skewed length mix. Built once per output
folder (`prepare`), then read by every case.

The tokenizer has exactly `vocab` entries: words w0..w{vocab-5} and the specials
<s>, </s>, <pad>, <unk>, split on whitespace only, with <s> prepended like
Llama's. A row's text is space-separated words, so it maps 1:1 onto tokens and
both stacks see identical token ids:
  project   tokenizer(prompt) = <s> + prompt words; response words + </s>
  TRL       tokenizer(prompt) and tokenizer(prompt + completion + "</s>"), the
            completion starting where the two diverge (the prompt ends in a space)
<pad> never occurs in the data, so "real tokens" is simply `input_ids != pad`.

Lengths: the total tokens of a row (bos and eos included) are lognormal around a
median (400 for the 1B shape, sigma 0.8: p90 ~2.8x the median), capped at
max_len; about a quarter of a row is prompt. Micro batches of 4 random rows then
carry ~47% padding, which is what padding-free training removes. The memory
matrix uses separate rows of exactly max_len tokens: the planner estimates the
worst case, so the worst case is what it is compared with.

Only `build_model_and_tokenizer` needs torch and transformers.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

from core.shapes import read_config_json

# Published config.json numbers (rope scaling left out: it changes no cost).
SHAPES = {
    "tiny": dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True, rope_theta=10000.0,
        max_len=128, median_tokens=32,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        max_len=2048, median_tokens=400,
    ),
    "llama-3.2-3b": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        max_len=2048, median_tokens=400,
    ),
}

LENGTH_SIGMA = 0.8
PROMPT_SHARE = 0.25
EVAL_ROWS = 8  # the stages evaluate before and after training; 8 rows keep that cheap
FULL_ROWS = 96  # max_len rows for the memory matrix: 3 steps of 2 micro batches of 8 need 48
SPECIALS = ["<s>", "</s>", "<pad>", "<unk>"]
SEED = 1234


def shape_config(shape: str, max_len: int) -> dict:
    """The model config fields of a shape, positions capped at the benchmark length."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape '{shape}'; known: {', '.join(SHAPES)}")
    fields = {k: v for k, v in SHAPES[shape].items() if k not in ("max_len", "median_tokens")}
    return {**fields, "max_position_embeddings": max_len}


# --------------------------------------------------------------------------- rows


def _word(rng: random.Random, n_words: int) -> str:
    return f"w{rng.randrange(n_words)}"


def _words(rng: random.Random, n_words: int, count: int) -> str:
    return " ".join(_word(rng, n_words) for _ in range(count))


def _total_tokens(rng: random.Random, median: int, max_len: int, full: bool) -> int:
    if full:
        return max_len
    return min(max_len, max(8, round(rng.lognormvariate(math.log(median), LENGTH_SIGMA))))


def _row_lengths(rng: random.Random, median: int, max_len: int, full: bool) -> tuple[int, int]:
    """(total tokens of the row, prompt words): <s> + prompt words is about PROMPT_SHARE of the row."""
    total = _total_tokens(rng, median, max_len, full)
    return total, max(1, round(total * PROMPT_SHARE) - 1)


def sft_rows(count: int, vocab: int, median: int, max_len: int, seed: int, full: bool = False) -> list[dict]:
    """prompt/response rows whose tokenised length (with <s> and </s>) follows the length mix."""
    rng, n_words = random.Random(seed), vocab - len(SPECIALS)
    rows = []
    for _ in range(count):
        total, prompt = _row_lengths(rng, median, max_len, full)
        response = max(1, total - prompt - 2)
        # The trailing space ends the prompt on a word boundary, so TRL's prompt + completion
        # string splits exactly where the project's separate tokenisation does.
        rows.append({"prompt": _words(rng, n_words, prompt) + " ", "response": _words(rng, n_words, response)})
    return rows


def dpo_rows(count: int, vocab: int, median: int, max_len: int, seed: int, full: bool = False) -> list[dict]:
    """prompt/chosen/rejected rows: chosen from the length mix, rejected drawn on its own."""
    rng, n_words = random.Random(seed), vocab - len(SPECIALS)
    rows = []
    for _ in range(count):
        total, prompt = _row_lengths(rng, median, max_len, full)
        room = max_len - prompt - 2
        chosen = max(1, min(room, total - prompt - 2))
        rejected = chosen if full else max(1, min(room, _total_tokens(rng, median, max_len, False) - prompt - 2))
        rows.append({
            "prompt": _words(rng, n_words, prompt) + " ",
            "chosen": _words(rng, n_words, chosen),
            "rejected": _words(rng, n_words, rejected),
        })
    return rows


def sequence_lengths(rows: list[dict]) -> list[int]:
    """Tokens of every sequence the rows become (<s> + prompt + response + </s>)."""
    lengths = []
    for row in rows:
        prompt = len(row["prompt"].split()) + 1
        for key in ("response", "chosen", "rejected"):
            if key in row:
                lengths.append(prompt + len(row[key].split()) + 1)
    return lengths


def length_stats(rows: list[dict], micro_batch: int = 4) -> dict:
    """Mean and attention-weighted length, and the padding a padded micro batch of random rows carries."""
    lengths = sequence_lengths(rows)
    per_row = len(lengths) // len(rows)
    padded = real = 0
    for start in range(0, len(rows) - micro_batch + 1, micro_batch):
        batch = lengths[start * per_row:(start + micro_batch) * per_row]
        padded += len(batch) * max(batch)
        real += sum(batch)
    return {
        "sequences": len(lengths),
        "mean_tokens": sum(lengths) / len(lengths),
        "median_tokens": sorted(lengths)[len(lengths) // 2],
        "max_tokens": max(lengths),
        # sum(s^2)/sum(s): the sequence length that attention FLOPs per token see on average
        "attention_length": sum(s * s for s in lengths) / sum(lengths),
        "padded_share_mb4": 1 - real / padded if padded else 0.0,
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def data_files(rows: int, vocab: int, median: int, max_len: int) -> dict[str, list[dict]]:
    """The rows of every data file a workload folder holds, by name: the same rows for the same
    arguments (fixed seeds), so a recorded case's data can be made again without its folder."""
    return {
        "sft": sft_rows(rows, vocab, median, max_len, SEED),
        "sft-eval": sft_rows(EVAL_ROWS, vocab, median, max_len, SEED + 1),
        "dpo": dpo_rows(rows, vocab, median, max_len, SEED + 2),
        "dpo-eval": dpo_rows(EVAL_ROWS, vocab, median, max_len, SEED + 3),
        "sft-full": sft_rows(min(rows, FULL_ROWS), vocab, median, max_len, SEED + 4, full=True),
        "dpo-full": dpo_rows(min(rows, FULL_ROWS), vocab, median, max_len, SEED + 5, full=True),
    }


# --------------------------------------------------------------------------- the workload folder


def describe(shape: str, max_len: int, rows: int, dtype: str) -> dict:
    """What a workload folder holds; a folder with the same description is reused."""
    return {"shape": shape, "max_len": max_len, "rows": rows, "dtype": dtype, "seed": SEED,
            "length_sigma": LENGTH_SIGMA, "prompt_share": PROMPT_SHARE}


def load(folder: Path) -> dict | None:
    path = folder / "workload.json"
    return json.loads(path.read_text()) if path.is_file() else None


def prepare(folder: Path, shape: str, max_len: int, rows: int, dtype: str, device: str) -> dict:
    """The workload of a named shape (SHAPES) in `folder`; see build."""
    median = min(SHAPES[shape]["median_tokens"], max_len // 4)
    return build(folder, describe(shape, max_len, rows, dtype), shape_config(shape, max_len), median, device)


def build(folder: Path, wanted: dict, config_fields: dict, median: int, device: str) -> dict:
    """Write model/ (config_fields: its config.json fields), the data files and workload.json
    (last: it marks the folder complete). `wanted` is describe()'s; a folder with the same
    description is reused, and the model is kept when only the number of rows changed."""
    existing = load(folder)
    if existing is not None and existing["described"] == wanted:
        return existing
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "workload.json").unlink(missing_ok=True)
    max_len, rows, dtype = wanted["max_len"], wanted["rows"], wanted["dtype"]
    files = data_files(rows, config_fields["vocab_size"], median, max_len)
    for name, content in files.items():
        _write_jsonl(folder / f"{name}.jsonl", content)
    model_marker = folder / "model" / "benchmark-model.json"
    model_described = {k: wanted[k] for k in ("shape", "max_len", "dtype", "seed")}
    if not model_marker.is_file() or json.loads(model_marker.read_text()) != model_described:
        shutil.rmtree(folder / "model", ignore_errors=True)
        build_model_and_tokenizer(folder / "model", config_fields, dtype, device)
        model_marker.write_text(json.dumps(model_described) + "\n")
    model_shape = read_config_json(folder / "model" / "config.json")
    info = {
        "described": wanted,
        "folder": str(folder.resolve()),
        "model": str((folder / "model").resolve()),
        "n_params": model_shape.n_params,
        "median_setting": median,
        "data": {name: {"path": str((folder / f"{name}.jsonl").resolve()), **length_stats(content)}
                 for name, content in files.items()},
    }
    (folder / "workload.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def model_flops_per_token(info: dict, data: str, live_reference: bool) -> float:
    """Model FLOPs per real token with core/flops.py (the planner's and the stages' formula):
    forward + backward of the trained model at the data's attention-weighted length s (so that
    per-token attention averages to the per-sequence sum), plus a live reference's forward.
    Recompute is not counted."""
    from core.flops import backward_flops_per_token, forward_flops_per_token

    shape = read_config_json(Path(info["model"]) / "config.json")
    s = info["data"][data]["attention_length"]
    forward = forward_flops_per_token(shape, "lm", s)
    return forward + backward_flops_per_token(shape, "lm", s) + (forward if live_reference else 0.0)


def build_model_and_tokenizer(folder: Path, config_fields: dict, dtype: str, device: str) -> None:
    """Random-init LlamaForCausalLM saved with save_pretrained, and the word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab_size = config_fields["vocab_size"]
    words = {f"w{i}": i for i in range(vocab_size - len(SPECIALS))}
    ids = {name: len(words) + i for i, name in enumerate(SPECIALS)}
    core = Tokenizer(models.WordLevel({**words, **ids}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                        special_tokens=[("<s>", ids["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} entries, the model {vocab_size}")

    # config.json's own fields (e.g. attention_bias from core/shapes.py) win over these defaults
    defaults = dict(rms_norm_eps=1e-5, hidden_act="silu", initializer_range=0.02, attention_bias=False, mlp_bias=False)
    fields = {k: v for k, v in config_fields.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**{**defaults, **fields}, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                         pad_token_id=ids["<pad>"])
    torch.manual_seed(SEED)
    # Initialised on the GPU when there is one: seconds instead of a minute for 1B on CPU.
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]).to("cpu")
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
