"""The built-in tiny model and synthetic task, so the default pipeline needs no network.

- `builtin:tiny-llama`: a randomly initialised Llama (2 layers, hidden 64) with a
  character-level tokenizer, saved with `save_pretrained` and then loaded back
  through the normal loading path like any other model folder.
- `builtin:digits`: sort a short digit string. Answers are checkable, so the
  same rows serve SFT (prompt/response), preference training (chosen = sorted,
  rejected = the same digits out of order) and rule-based rewards (label).
  `demo` is what an imperfect demonstrator wrote: the right digits, but most
  of the time with a trailing period that an exact-match check rejects. A
  model fine-tuned on `demo` imitates the habit, which leaves RL with an
  exact-match reward something real to fix.

Both are written deterministically; every process may call `materialize` at once:
each writes a private temporary folder and renames it into place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from core.failure import saving

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = list("0123456789abcdefghijklmnopqrstuvwxyz :=?!.,\n")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] + ': ' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}"
)
DIGITS_SPLITS = {"train": 4000, "eval": 200}
DIGITS_LENGTHS = (3, 6)
DEMO_PERIOD_RATE = 0.6  # how often the demonstrator ends an answer with "."


# --------------------------------------------------------------------------- task


def digits_row(rng: random.Random) -> dict:
    """One sorting problem: prompt, response, chosen, rejected and label."""
    length = rng.randint(*DIGITS_LENGTHS)
    digits = [rng.choice("0123456789") for _ in range(length)]
    answer = "".join(sorted(digits))
    wrong = digits[:]
    while "".join(wrong) == answer:  # a permutation that is not sorted
        rng.shuffle(wrong)
        if len(set(wrong)) == 1:  # all equal digits: change one so it differs
            wrong[0] = str((int(wrong[0]) + 1) % 10)
    period = "." if rng.random() < DEMO_PERIOD_RATE else ""
    return {
        "prompt": f"sort {''.join(digits)} =",
        "response": f" {answer}",
        "demo": f" {answer}{period}",
        "chosen": f" {answer}",
        "rejected": f" {''.join(wrong)}",
        "label": answer,
    }


def digits_answer_is_correct(prompt: str, completion: str) -> bool:
    """True when the completion is the prompt's digits in ascending order."""
    digits = prompt.removeprefix("sort ").removesuffix(" =").strip()
    return completion.strip() == "".join(sorted(digits))


def digits_splits(seed: int = 1234):
    """(split, rows) of the digits task, train then eval, with disjoint prompts: what
    write_digits writes (the planner reads the rows from here, without writing them)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    for split, count in DIGITS_SPLITS.items():
        rows: list[dict] = []
        while len(rows) < count:
            row = digits_row(rng)
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                rows.append(row)
        yield split, rows


def write_digits(dest: Path, seed: int = 1234) -> None:
    """train.jsonl and eval.jsonl of the digits task (disjoint prompts)."""

    def write(tmp: Path):
        for split, rows in digits_splits(seed):
            with open(tmp / f"{split}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")

    write_atomically(dest, write)


# --------------------------------------------------------------------------- model


def build_core_tokenizer():
    """The character-level `tokenizers` Tokenizer (adds <s> in front, like Llama's); no
    transformers, so the planner can count tokens with it on a login node."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return core


def build_tokenizer():
    """A character-level fast tokenizer that adds <s> in front, like Llama's."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_core_tokenizer(), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
        # As Llama's tokenizer says; transformers 4.x would otherwise add token_type_ids,
        # which Llama's forward and generate reject.
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def import_model_code() -> None:
    """Import what writing and loading the tiny Llama needs (the slow part of writing it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401


def write_tiny_llama(dest: Path, seed: int = 0) -> None:
    """Save a random tiny Llama and its tokenizer in Hugging Face format."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def write(tmp: Path):
        tokenizer = build_tokenizer()
        # rope_theta: a field on transformers 4.x; on 5.x a legacy keyword turned into rope_parameters.
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            # Heads of 32 dimensions: vLLM's CPU attention takes no smaller (its test rollouts).
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    write_atomically(dest, write)


# --------------------------------------------------------------------------- placing


def is_materialized(name: str, root: Path) -> bool:
    """Whether built-in `name` has been written under root."""
    return (Path(root) / name / ".complete").exists()


def materialize(name: str, root: Path) -> Path:
    """Folder of built-in `name` (tiny-llama or digits) under root, written once."""
    dest = Path(root) / name
    if not is_materialized(name, root):
        {"tiny-llama": write_tiny_llama, "digits": write_digits}[name](dest)
    return dest


def write_atomically(dest: Path, write) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        with saving(tmp, f"the built-in {dest.name}"):  # a refused write names its path and cause
            write(tmp)
            (tmp / ".complete").touch()
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race; its copy is identical
            if not (dest / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
