"""Rows to tokens: loading, the train/eval split, tokenisation, padding and batching.

Tokenised rows are dicts of plain lists. Prompt and response are tokenised
separately so the boundary between them is exact: the loss mask covers the
response tokens (and the closing eos) only.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
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


def sequences_of(row: dict) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each sequence of a tokenised row: one for SFT rows,
    chosen then rejected for preference pairs."""
    if "input_ids" in row:
        return [(row["input_ids"], row["loss_mask"])]
    return [(row[f"{side}_input_ids"], row[f"{side}_loss_mask"]) for side in ("chosen", "rejected")]


def row_tokens(row: dict) -> int:
    """Tokens of a tokenised row, all its sequences together: what packing budgets."""
    return sum(len(ids) for ids, _ in sequences_of(row))


def trained_tokens(row: dict) -> int:
    """Positions whose next token the loss learns (the first token of a sequence never is)."""
    return sum(sum(mask[1:]) for _, mask in sequences_of(row))


@dataclass
class Batch:
    """Token tensors for one forward pass, padded or packed, and where each sequence is.

    Sequences are numbered in row order (a pair: chosen 2k, rejected 2k+1). Padded:
    one sequence per line, right-padded, with a 2D padding mask. Packed: several
    sequences per line, each with positions from 0; `forward` runs the model inside
    `apart()`, where every attention layer keeps them apart (stages/compat.py).
    """

    input_ids: object  # (lines, width) torch.long
    position_ids: object  # (lines, width): each sequence counts from 0
    loss_mask: object  # (lines, width): 1 on tokens the model learns to produce; 0 on padding and sequence starts
    sequence: object  # (lines, width): index of the sequence at each position, -1 on padding
    packed: bool
    lengths: list  # tokens of each sequence, in sequence order (host-side)

    @property
    def n_sequences(self) -> int:
        return len(self.lengths)

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def processed_tokens(self) -> int:
        return self.input_ids.numel()

    def apart(self):
        """Context in which a model's forward (and the backward that may recompute it)
        keeps this batch's packed sequences apart (stages/compat.py)."""
        from stages import compat

        return compat.sequences_apart(self.sequence if self.packed else None)

    @property
    def attention_mask(self):
        """The 2D padding mask of a padded batch (1 on tokens); None for a packed one."""
        return None if self.packed else (self.sequence >= 0).long()

    def forward(self, model):
        """The model's output on this batch. No KV cache in training passes (transformers 5
        would build one, and then read no packed positions)."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if not self.packed:
            inputs["attention_mask"] = self.attention_mask
        with self.apart():
            return model(**inputs)

    def per_sequence(self, per_token):
        """Sum a (lines, width - 1) per-target-token tensor (e.g. token_logprobs) into (sequences,)."""
        import torch

        owner = self.sequence[:, 1:].reshape(-1)
        values = per_token.reshape(-1)
        keep = owner >= 0
        out = torch.zeros(self.n_sequences, dtype=values.dtype, device=values.device)
        return out.index_add(0, owner[keep], values[keep])

    def last_tokens(self, skip_id=None):
        """Flat index (line * width + position) of each sequence's last token; with
        skip_id, of its last token that is not skip_id (how transformers' sequence
        classifiers pick the token they score when the pad id is also the eos id)."""
        import torch

        flat = self.sequence.reshape(-1)
        keep = flat >= 0
        if skip_id is not None:
            keep &= self.input_ids.reshape(-1) != skip_id
        index = torch.arange(flat.numel(), device=flat.device)
        out = torch.full((self.n_sequences,), -1, dtype=torch.long, device=flat.device)
        return out.scatter_reduce(0, flat[keep], index[keep], reduce="amax")

    def to(self, device) -> "Batch":
        moved = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in vars(self).items()}
        return Batch(**moved)


def padded_batch(rows: list[dict], pad_id: int) -> Batch:
    """The rows' sequences one per line, right-padded to the longest."""
    import torch

    seqs = [s for row in rows for s in sequences_of(row)]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    sequence = torch.full((len(seqs), width), -1, dtype=torch.long)
    for k, (seq_ids, seq_mask) in enumerate(seqs):
        n = len(seq_ids)
        ids[k, :n] = torch.tensor(seq_ids)
        mask[k, 1:n] = torch.tensor(seq_mask[1:])
        sequence[k, :n] = k
    positions = torch.arange(width).expand(len(seqs), width).clone()
    return Batch(ids, positions, mask, sequence, False, [len(s) for s, _ in seqs])


def packed_batch(rows: list[dict], pad_id: int, line_tokens: int) -> Batch:
    """The rows' sequences packed on lines (stages/batching.py pack_lines), with no
    padding but what evens the lines out; line_tokens 0 puts them on one line."""
    import torch

    from stages.batching import pack_lines

    seqs = [s for row in rows for s in sequences_of(row)]
    lines = pack_lines([len(ids) for ids, _ in seqs], line_tokens)
    width = max(sum(len(seqs[k][0]) for k in line) for line in lines)
    shape = (len(lines), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.long)
    sequence = torch.full(shape, -1, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    for j, line in enumerate(lines):
        at = 0
        for k in line:
            seq_ids, seq_mask = seqs[k]
            n = len(seq_ids)
            ids[j, at : at + n] = torch.tensor(seq_ids)
            mask[j, at + 1 : at + n] = torch.tensor(seq_mask[1:])  # a sequence's first token is never a target
            sequence[j, at : at + n] = k
            positions[j, at : at + n] = torch.arange(n)
            at += n
        positions[j, at:] = torch.arange(width - at)  # the tail: a padding "sequence" of its own
    return Batch(ids, positions, mask, sequence, True, [len(s) for s, _ in seqs])


class TokenRows:
    """A split's tokenised rows, and how they become this process's batches: packed by
    a token budget (stage.packing) or padded micro batches of micro_batch_size rows."""

    def __init__(self, rows: list[dict], stage, ctx, pad_id: int, attention: str, sequences_per_row: int):
        from stages import compat

        self.rows, self.stage, self.ctx, self.pad_id = rows, stage, ctx, pad_id
        self.lengths = [row_tokens(r) for r in rows]
        self.trained = [trained_tokens(r) for r in rows]
        self.budget = token_budget(stage, sequences_per_row) if stage.packing else None
        # Varlen kernels take every sequence on one line; masks want lines about max_len long.
        self.line_tokens = 0 if compat.flat_packing(attention) else stage.max_len

    def __len__(self) -> int:
        return len(self.rows)

    def steps(self, epoch: int, rows_per_step: int) -> list:
        from stages import batching

        return batching.epoch_steps(
            len(self.rows), rows_per_step=rows_per_step, micro_batch_size=self.stage.micro_batch_size,
            rank=self.ctx.rank, world_size=self.ctx.world_size, seed=self.stage.seed, epoch=epoch,
            lengths=self.lengths, token_budget=self.budget)

    def eval_micro_batches(self) -> list:
        from stages import batching

        return batching.eval_micro_batches(
            len(self.rows), micro_batch_size=self.stage.micro_batch_size, rank=self.ctx.rank,
            world_size=self.ctx.world_size, lengths=self.lengths, token_budget=self.budget)

    def batch(self, micro) -> Batch:
        rows = [self.rows[i] for i in micro.rows]
        built = packed_batch(rows, self.pad_id, self.line_tokens) if self.budget else padded_batch(rows, self.pad_id)
        return built.to(self.ctx.device)

    def trained_in(self, rows) -> int:
        """Trained tokens of these rows (a step's: the normaliser of per-token means)."""
        return sum(self.trained[i] for i in rows)


def token_budget(stage, sequences_per_row: int) -> int:
    """Tokens per process per packed micro batch: micro_batch_tokens, else what a padded
    micro batch of micro_batch_size rows of max_len tokens would hold."""
    return stage.micro_batch_tokens or stage.micro_batch_size * stage.max_len * sequences_per_row
