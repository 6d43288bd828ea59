"""Rows to tokens: loading, the train/eval split, tokenisation, padding and batching.

Tokenised rows are dicts of plain lists. Prompt and response are tokenised
separately so the boundary between them is exact: the loss mask covers the
response tokens (and the closing eos) only.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from pipeline.config import BUILTIN_PREFIX, DataSpec
from pipeline.errors import InvalidInput
from pipeline.rows import is_row_file, read_rows, select_rows
from stages import tiny

log = logging.getLogger("stages")


# --------------------------------------------------------------------------- loading


def load_splits(data: DataSpec, kind: str, builtin_root: Path, seed: int) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows), checked for the columns the stage kind needs; invalid rows
    stop the stage or, when the pipeline file says so, are left out with a count in the log."""
    if data.is_builtin:
        folder = tiny.materialize(data.path[len(BUILTIN_PREFIX):], builtin_root)
        train = read_rows(folder / f"{data.split}.jsonl")
        held_out = read_rows(folder / f"{data.eval_split or 'eval'}.jsonl")
    elif is_row_file(data.path):
        train = read_rows(Path(data.path))
        held_out = read_rows(Path(data.eval_split)) if data.eval_split else None
    else:
        train = _load_dataset_split(data.path, data.split)
        held_out = _load_dataset_split(data.path, data.eval_split) if data.eval_split else None
    train = _usable(train, kind, data, f"{data.path} ({data.split})")
    if held_out is None:
        shuffled = train[:]
        random.Random(seed).shuffle(shuffled)
        n_eval = max(1, int(len(shuffled) * data.eval_fraction))
        held_out, train = shuffled[:n_eval], shuffled[n_eval:]
    else:
        held_out = _usable(held_out, kind, data, f"{data.path} ({data.eval_split})")
    if data.max_rows:
        train = train[: data.max_rows]
    return train, held_out


def _usable(rows: list[dict], kind: str, data: DataSpec, source: str) -> list[dict]:
    kept, skipped = select_rows(rows, kind, data, source)
    if skipped:
        log.warning("%s: skipped %d invalid rows (data.invalid_rows: skip)", source, skipped)
    return kept


def _load_dataset_split(path: str, split: str) -> list[dict]:
    import datasets

    try:
        if Path(path).is_dir() and (Path(path) / "dataset_dict.json").exists():
            return list(datasets.load_from_disk(path)[split])
        if Path(path).is_dir() and (Path(path) / "dataset_info.json").exists():
            return list(datasets.load_from_disk(path))
        return list(datasets.load_dataset(path, split=split))
    except (FileNotFoundError, ValueError, KeyError, ConnectionError) as err:
        raise InvalidInput(f"{path}: cannot load split '{split}': {err}") from None


# --------------------------------------------------------------------------- tokenising


def prompt_messages(row: dict, data: DataSpec) -> list[dict]:
    return [{"role": "user", "content": row[data.prompt_key]}]


def encode_prompt(tokenizer, prompt: str, data: DataSpec) -> list[int]:
    if data.chat_template:
        return _chat_ids(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer(prompt)["input_ids"]


def encode_response(tokenizer, prompt: str, response: str, data: DataSpec) -> list[int]:
    """Response tokens that follow encode_prompt(prompt), closing eos included."""
    if data.chat_template:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        prefix = _chat_ids(tokenizer, messages[:1], add_generation_prompt=True)
        full = _chat_ids(tokenizer, messages, add_generation_prompt=False)
        return full[len(prefix):]
    return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _chat_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    from stages import compat  # imports torch; this module stays torch-free until it is needed

    return compat.chat_template_ids(tokenizer, messages, add_generation_prompt)


def tokenize_sft(row: dict, tokenizer, data: DataSpec, max_len: int) -> dict:
    """input_ids and a loss mask that is 1 on the tokens the model must learn to produce."""
    if data.prompt_key in row and data.response_key in row:
        prompt_ids = encode_prompt(tokenizer, row[data.prompt_key], data)
        response_ids = encode_response(tokenizer, row[data.prompt_key], row[data.response_key], data)
        ids = prompt_ids + response_ids
        mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    else:  # chat messages: learn every assistant turn
        messages = row[data.messages_key]
        ids, mask = [], []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
            full = _chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
            mask += [0] * (len(prefix) - len(ids)) + [1] * (len(full) - len(prefix))
            ids = full
    return {"input_ids": ids[:max_len], "loss_mask": mask[:max_len]}


def tokenize_pair(row: dict, tokenizer, data: DataSpec, max_len: int) -> dict:
    """Prompt + chosen and prompt + rejected, each with its response mask."""
    prompt = row[data.prompt_key]
    prompt_ids = encode_prompt(tokenizer, prompt, data)
    out = {}
    for side, key in (("chosen", data.chosen_key), ("rejected", data.rejected_key)):
        response_ids = encode_response(tokenizer, prompt, row[key], data)
        ids = (prompt_ids + response_ids)[:max_len]
        mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_len]
        out[f"{side}_input_ids"], out[f"{side}_loss_mask"] = ids, mask
    return out


# --------------------------------------------------------------------------- batching


def pad_batch(rows: list[dict], pad_id: int, keys=("input_ids", "loss_mask")) -> dict:
    """Right-pad lists to the longest row; adds attention_mask. Returns torch tensors."""
    import torch

    ids_key = keys[0]
    width = max(len(r[ids_key]) for r in rows)
    batch = {}
    for key in keys:
        fill = pad_id if key.endswith("input_ids") else 0
        batch[key] = torch.tensor([r[key] + [fill] * (width - len(r[key])) for r in rows])
    batch["attention_mask"] = torch.tensor([[1] * len(r[ids_key]) + [0] * (width - len(r[ids_key])) for r in rows])
    return batch


def pad_pairs(pairs: list[dict], pad_id: int, device) -> dict:
    """Chosen rows then rejected rows of tokenize_pair outputs, in one padded batch of 2B."""
    rows = [{"input_ids": p[f"{side}_input_ids"], "loss_mask": p[f"{side}_loss_mask"]}
            for side in ("chosen", "rejected") for p in pairs]
    return {k: v.to(device) for k, v in pad_batch(rows, pad_id).items()}


def micro_batches(n_rows: int, micro_batch_size: int, rank: int, world_size: int, seed: int, epoch: int):
    """This rank's micro batches (lists of row indices) for one epoch.

    Every rank shuffles with the same seed, drops the ragged tail so all ranks
    take the same number of steps, and takes every world_size-th micro batch.
    The order depends only on (seed, epoch): resuming at micro batch k of an
    epoch sees exactly what an uninterrupted run would have seen.
    """
    order = list(range(n_rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    per_round = micro_batch_size * world_size
    usable = (n_rows // per_round) * per_round
    return [
        order[start + rank * micro_batch_size : start + (rank + 1) * micro_batch_size]
        for start in range(0, usable, per_round)
    ]


def eval_batches(n_rows: int, micro_batch_size: int, rank: int, world_size: int):
    """(row indices, weights) micro batches covering every eval row once over all ranks.

    Every rank gets the same number of batches, because under ZeRO-3 each forward
    pass needs all ranks; the padding entries repeat row 0 with weight 0.
    """
    per_round = micro_batch_size * world_size
    total = -(-n_rows // per_round) * per_round
    indices = list(range(n_rows)) + [0] * (total - n_rows)
    weights = [1.0] * n_rows + [0.0] * (total - n_rows)
    out = []
    for start in range(0, total, per_round):
        mine = slice(start + rank * micro_batch_size, start + (rank + 1) * micro_batch_size)
        out.append((indices[mine], weights[mine]))
    return out
