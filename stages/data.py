"""Rows to tokens: loading, the train/eval split, tokenisation, what max_len cuts,
padding and batching.

Tokenised rows are dicts of plain lists. Prompt and response are tokenised
separately so the boundary between them is exact: the loss mask covers the
response tokens (and the closing eos) only. Rows that max_len leaves with nothing
to learn are dropped, and a stage that max_len cuts too much is refused (see
"truncation" below; `python -m stages.measure_truncation` is validate's run of the same code).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from core import batching, kinds, tiny
from core.config import BUILTIN_PREFIX, DataSpec
from core.errors import InvalidInput
from core.rows import eval_copies, hold_out, is_row_file, read_rows, select_rows
from stages import watchdog

if TYPE_CHECKING:  # torch loads where a batch is built: this module's readers of rows stay without it
    import torch

log = logging.getLogger("stages")


# --------------------------------------------------------------------------- loading


def load_splits(data: DataSpec, kind: str, builtin_root: Path, seed: int) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows), checked for the columns the stage kind needs; invalid rows
    stop the stage or, when the pipeline file says so, are left out with a count in the log."""
    if data.is_builtin:
        folder = tiny.materialize(data.path[len(BUILTIN_PREFIX):], builtin_root)
        train = read_rows(folder / f"{data.split}.jsonl")
        held_out: list[dict] | None = read_rows(folder / f"{data.eval_split or 'eval'}.jsonl")
    elif is_row_file(data.path):
        train = read_rows(Path(data.path))
        held_out = read_rows(Path(data.eval_split)) if data.eval_split else None
    else:
        train = _load_dataset_split(data.path, data.split)
        held_out = _load_dataset_split(data.path, data.eval_split) if data.eval_split else None
    train = _usable(train, kind, data, f"{data.path} ({data.split})")
    if held_out is None:
        train, held_out = hold_out(train, data.eval_fraction, seed)
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


def encode_prompts(tokenizer, prompts: list[str], data: DataSpec) -> list[list[int]]:
    """Each prompt's tokens, special tokens (bos) included; plain text in one batched call."""
    if data.chat_template:
        return [_chat_ids(tokenizer, [{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    return tokenizer(list(prompts))["input_ids"] if prompts else []


def encode_responses(tokenizer, prompts: list[str], responses: list[str], data: DataSpec) -> list[list[int]]:
    """Each response's tokens as they follow encode_prompts(prompt), closing eos included."""
    if data.chat_template:
        out = []
        for prompt, response in zip(prompts, responses):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            prefix = _chat_ids(tokenizer, messages[:1], add_generation_prompt=True)
            out.append(_chat_ids(tokenizer, messages, add_generation_prompt=False)[len(prefix):])
        return out
    if not responses:
        return []
    return [ids + [tokenizer.eos_token_id] for ids in tokenizer(list(responses), add_special_tokens=False)["input_ids"]]


def encode_prompt(tokenizer, prompt: str, data: DataSpec) -> list[int]:
    return encode_prompts(tokenizer, [prompt], data)[0]


def encode_response(tokenizer, prompt: str, response: str, data: DataSpec) -> list[int]:
    return encode_responses(tokenizer, [prompt], [response], data)[0]


def _chat_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    from stages import compat  # imports torch; this module stays torch-free until it is needed

    return compat.chat_template_ids(tokenizer, messages, add_generation_prompt)


Sequence = tuple[list[int], list[int]]  # (input_ids, loss_mask), before max_len


def _sft_sequences(rows: list[dict], tokenizer, data: DataSpec) -> list[tuple[Sequence]]:
    """Each row's one sequence: its tokens and a loss mask that is 1 on the tokens the model must
    learn to produce."""
    out: list = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if data.prompt_key in row and data.response_key in row]
    prompts = [rows[i][data.prompt_key] for i in plain]
    responses = encode_responses(tokenizer, prompts, [rows[i][data.response_key] for i in plain], data)
    for i, prompt_ids, response_ids in zip(plain, encode_prompts(tokenizer, prompts, data), responses):
        out[i] = ((prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)),)
    for i, row in enumerate(rows):
        if out[i] is None:  # chat messages: learn every assistant turn
            messages = row[data.messages_key]
            ids: list[int] = []
            mask: list[int] = []
            for j, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                prefix = _chat_ids(tokenizer, messages[:j], add_generation_prompt=True)
                full = _chat_ids(tokenizer, messages[: j + 1], add_generation_prompt=False)
                mask += [0] * (len(prefix) - len(ids)) + [1] * (len(full) - len(prefix))
                ids = full
            out[i] = ((ids, mask),)
    return out


def _pair_sequences(rows: list[dict], tokenizer, data: DataSpec) -> list[tuple[Sequence, Sequence]]:
    """Prompt + chosen and prompt + rejected of each row, each with its response mask."""
    prompts = [row[data.prompt_key] for row in rows]
    prompt_ids = encode_prompts(tokenizer, prompts, data)
    chosen, rejected = (encode_responses(tokenizer, prompts, [row[key] for row in rows], data)
                        for key in (data.chosen_key, data.rejected_key))
    return [((p + c, [0] * len(p) + [1] * len(c)), (p + r, [0] * len(p) + [1] * len(r)))
            for p, c, r in zip(prompt_ids, chosen, rejected)]


def _cut(sequences, max_len: int) -> dict:
    """A tokenised row (the form sequences_of reads) with each sequence cut to max_len."""
    if len(sequences) == 1:
        (ids, mask), = sequences
        return {"input_ids": ids[:max_len], "loss_mask": mask[:max_len]}
    out = {}
    for side, (ids, mask) in zip(("chosen", "rejected"), sequences):
        out[f"{side}_input_ids"], out[f"{side}_loss_mask"] = ids[:max_len], mask[:max_len]
    return out


def tokenize_sft(row: dict, tokenizer, data: DataSpec, max_len: int) -> dict:
    """input_ids and a loss mask that is 1 on the tokens the model must learn to produce."""
    return _cut(_sft_sequences([row], tokenizer, data)[0], max_len)


def tokenize_pair(row: dict, tokenizer, data: DataSpec, max_len: int) -> dict:
    """Prompt + chosen and prompt + rejected, each with its response mask."""
    return _cut(_pair_sequences([row], tokenizer, data)[0], max_len)


# --------------------------------------------------------------------------- truncation
#
# max_len cuts every sequence that is longer. A row "loses tokens" when any of its
# sequences is cut, and has "nothing to learn" when, after the cut, the loss can
# learn nothing from it:
#   sft       no response token left (the prompt fills max_len);
#   rm, dpo   chosen or rejected has no response token left, or the two are the same
#             tokens (equal rewards and log-probs: the gradient is zero);
#   ppo       a prompt row: it loses tokens when prompt + max_new_tokens > max_len (a
#             completion that long loses its tail in training, and the reward lands on the
#             last token kept), and has nothing to learn when the prompt alone fills max_len.
# Rows with nothing to learn are dropped. When more than max_truncated_share of a stage's
# rows (train and eval together) lose tokens or are dropped, the stage is refused.
# pipeline/truncation.py runs the same tokenized_splits in a subprocess at validate time.

NOTHING_TO_LEARN = {  # by the kind's row format (core/kinds.py)
    "completion": "no response token left",
    "preference": "no response token left, or chosen and rejected no longer differ",
    "prompt": "the prompt fills max_len",
}


def nothing_to_learn(row: dict) -> bool:
    """A tokenised sft/rm/dpo row the loss learns nothing from (see above)."""
    sequences = sequences_of(row)
    if any(sum(mask[1:]) == 0 for _, mask in sequences):
        return True
    return len(sequences) == 2 and sequences[0][0] == sequences[1][0]


@dataclass(frozen=True)
class Truncation:
    """What max_len does to one split's rows. Counts are of the `measured` rows (all of
    the split's `rows`, or a random sample of them at validate time)."""

    rows: int
    measured: int
    cut: int  # rows that lose tokens
    dropped: int  # rows left with nothing to learn
    affected: int  # rows that lose tokens or are dropped (a row can be dropped without a cut: equal pairs)
    lengths: tuple[int, ...] = ()  # each measured row's longest sequence before the cut (ppo: prompt + max_new_tokens)

    def record(self) -> dict:
        return {"rows": self.rows, "cut": self.cut, "dropped": self.dropped}


@dataclass
class TokenizedSplit:
    rows: list[dict]  # the rows kept, as loaded
    tokens: list[dict]  # the same rows tokenised and cut (ppo: {"input_ids": prompt ids}, not cut)
    truncation: Truncation


def tokenize(rows: list[dict], kind: str, tokenizer, data: DataSpec, max_len: int,
             max_new_tokens: int = 0) -> TokenizedSplit:
    """The rows tokenised and cut to max_len, those with nothing to learn left out, and the counts."""
    rows_format = kinds.get(kind).rows
    if rows_format == "prompt":
        prompts = encode_prompts(tokenizer, [row[data.prompt_key] for row in rows], data)
        tokens = [{"input_ids": ids} for ids in prompts]
        lengths = [len(ids) + max_new_tokens for ids in prompts]
        cut = [n > max_len for n in lengths]
        empty = [len(ids) >= max_len for ids in prompts]
    else:
        sequences = (_sft_sequences if rows_format == "completion" else _pair_sequences)(rows, tokenizer, data)
        tokens = [_cut(s, max_len) for s in sequences]
        lengths = [max(len(ids) for ids, _ in s) for s in sequences]
        cut = [n > max_len for n in lengths]
        empty = [nothing_to_learn(t) for t in tokens]
    keep = [i for i, e in enumerate(empty) if not e]
    truncation = Truncation(rows=len(rows), measured=len(rows), cut=sum(cut), dropped=len(rows) - len(keep),
                            affected=sum(c or e for c, e in zip(cut, empty)), lengths=tuple(sorted(lengths)))
    return TokenizedSplit([rows[i] for i in keep], [tokens[i] for i in keep], truncation)


@dataclass
class TokenizedSplits:
    """A stage's train and eval rows, tokenised and cut to max_len, and what the cut did."""

    train: TokenizedSplit
    eval: TokenizedSplit
    max_len: int

    def record(self) -> dict:
        """For result.json."""
        return {"max_len": self.max_len, "train": self.train.truncation.record(),
                "eval": self.eval.truncation.record()}

    def summary(self, kind: str) -> str:
        parts = [self.train.truncation, self.eval.truncation]
        measured, rows = sum(t.measured for t in parts), sum(t.rows for t in parts)
        sample = f", measured on a random {measured} of {rows} rows" if measured < rows else ""
        nothing = NOTHING_TO_LEARN[kinds.get(kind).rows]
        return f"max_len {self.max_len}{sample} (nothing to learn: {nothing}): " + "; ".join(
            f"{name}: {t.cut} of {t.measured} rows lose tokens, {t.dropped} have nothing to learn"
            for name, t in zip(("train", "eval"), parts))


def tokenized_splits(stage, tokenizer, builtin_root: Path, where: str = "", sample: int = 0) -> TokenizedSplits:
    """load_splits, tokenised and cut to stage.max_len, rows with nothing to learn dropped;
    InvalidInput when more than stage.max_truncated_share of the rows lose tokens or are
    dropped. `sample` > 0 measures a random sample of about that many rows (train and eval
    in proportion) instead of all: validate's bound on time (pipeline/truncation.py)."""
    where = where or f"stage {stage.name}"
    log.info("%s: reading and tokenising %s", where, stage.data.path)
    train, held_out = load_splits(stage.data, stage.kind, builtin_root, stage.seed)
    copies = eval_copies(train, held_out, stage.kind, stage.data)
    if copies:
        log.warning("%s: %s", where, copies)
    counts = (len(train), len(held_out))
    if 0 < sample < sum(counts):
        rng = random.Random(stage.seed)
        train, held_out = (rng.sample(rows, max(1, round(len(rows) * sample / sum(counts))))
                           for rows in (train, held_out))
    rl = kinds.rollouts_of(stage)
    max_new_tokens = rl.new_tokens if rl is not None else 0  # a prompt's room for its completion
    parts = [tokenize(rows, stage.kind, tokenizer, stage.data, stage.max_len, max_new_tokens)
             for rows in (train, held_out)]
    for part, rows in zip(parts, counts):
        part.truncation = replace(part.truncation, rows=rows)
    splits = TokenizedSplits(parts[0], parts[1], max_len=stage.max_len)
    check_truncation(stage, splits, where)
    log.info("%s: %s", where, splits.summary(stage.kind))
    if splits.train.truncation.dropped or splits.eval.truncation.dropped:
        log.warning("%s: dropped %d train and %d eval rows with nothing to learn within max_len %d (%s)", where,
                    splits.train.truncation.dropped, splits.eval.truncation.dropped, stage.max_len,
                    NOTHING_TO_LEARN[kinds.get(stage.kind).rows])
    return splits


def check_truncation(stage, splits: TokenizedSplits, where: str) -> None:
    """Refuse a stage whose max_len cuts more than max_truncated_share of its rows, or
    leaves a split with no row to learn from; the message says what max_len would do."""
    parts = (splits.train.truncation, splits.eval.truncation)
    measured, affected = sum(t.measured for t in parts), sum(t.affected for t in parts)
    limit = stage.max_truncated_share
    rl = kinds.rollouts_of(stage)
    if affected > limit * measured + 1e-9:
        lengths = sorted(n for t in parts for n in t.lengths)
        enough = lengths[len(lengths) - int(limit * len(lengths) + 1e-9) - 1]  # cuts at most the share allowed
        longest = f"prompt + {rl.fields.new_tokens}" if rl is not None else "row"
        fix = (f"Raise max_len to {enough} or more (the longest {longest} has {lengths[-1]} tokens)"
               if enough > stage.max_len
               else "Check the dropped rows (max_len is not what leaves them nothing to learn)")
        raise InvalidInput(
            f"{where}: max_len {stage.max_len} cuts {affected} of {measured} rows ({affected / measured:.1%}), "
            f"more than max_truncated_share ({limit:g}) allows.\n  {splits.summary(stage.kind)}.\n"
            f"{fix}{f', lower {rl.fields.new_tokens}' if rl is not None else ''}, "
            f"shorten the {'prompts' if rl is not None else 'rows'}, "
            "or raise max_truncated_share."
        )
    for name, split in (("train", splits.train), ("eval", splits.eval)):
        if not split.tokens:
            raise InvalidInput(f"{where}: no {name} row is left with anything to learn.\n  "
                               f"{splits.summary(stage.kind)}.\nRaise max_len.")


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
    `apart()`, where every attention layer keeps them apart (stages/packed_attention.py).
    """

    input_ids: torch.Tensor  # (lines, width) torch.long
    position_ids: torch.Tensor  # (lines, width): each sequence counts from 0
    loss_mask: torch.Tensor  # (lines, width): 1 on tokens the model learns to produce; 0 on padding and sequence starts
    sequence: torch.Tensor  # (lines, width): index of the sequence at each position, -1 on padding
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
        keeps this batch's packed sequences apart (stages/packed_attention.py)."""
        from stages import packed_attention

        return packed_attention.sequences_apart(self.sequence if self.packed else None)

    @property
    def attention_mask(self):
        """The 2D padding mask of a padded batch (1 on tokens); None for a packed one."""
        return None if self.packed else (self.sequence >= 0).long()

    @watchdog.phase(watchdog.FORWARD)
    def forward(self, model, **extra):
        """The model's output on this batch. No KV cache in training passes (transformers 5
        would build one, and then read no packed positions)."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False, **extra}
        if not self.packed:
            inputs["attention_mask"] = self.attention_mask
        with self.apart():
            return model(**inputs)

    def next_targets(self):
        """(targets, mask) of the positions the model runs on: the token each position predicts
        (the next one) and whether it is a response token."""
        return next_entries(self.input_ids), next_entries(self.loss_mask)

    def logprobs(self, logits):
        """(lines, width - 1): the log-prob of each next token where it is a response token, 0
        elsewhere (stages/losses.py token_logprobs' alignment), from the logits of the positions
        the model ran on."""
        from stages.losses import next_token_logprobs

        return self.gathered(next_token_logprobs(logits, *self.next_targets()))[:, :-1]

    def gathered(self, per_position):
        """Whole lines of a per-position output (a sharded batch gathers its group's pieces:
        stages/sequence_parallel.py); here the output itself."""
        return per_position

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

    def to(self, device) -> Batch:
        moved = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in vars(self).items()}
        return Batch(**moved)


def next_entries(tensor):
    """Each position's next entry along the line (0 after the last): what position t predicts."""
    import torch

    out = torch.zeros_like(tensor)
    out[:, :-1] = tensor[:, 1:]
    return out


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


def packed_batch(rows: list[dict], pad_id: int, flat: bool) -> Batch:
    """The rows' sequences packed on lines (core/batching.py pack_lines), with no
    padding but what evens the lines out; `flat` puts them on one line (varlen kernels)."""
    import torch

    from core.batching import line_tokens, pack_lines

    seqs = [s for row in rows for s in sequences_of(row)]
    lengths = [len(ids) for ids, _ in seqs]
    lines = pack_lines(lengths, line_tokens(lengths, flat))
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
        from stages import packed_attention, sequence_parallel

        self.rows, self.stage, self.ctx, self.pad_id = rows, stage, ctx, pad_id
        self.lengths = [row_tokens(r) for r in rows]
        self.trained = [trained_tokens(r) for r in rows]
        self.budget = batching.token_budget(stage, sequences_per_row) if stage.packing else None
        self.flat = packed_attention.flat_packing(attention)  # varlen kernels: every sequence on one line
        self.layout = sequence_parallel.layout()

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def rows_per_step(self) -> int:
        """Rows of one optimizer step over all processes (those sharing sequences count once)."""
        return batching.rows_per_step(self.stage.global_batch_size, self.stage.micro_batch_size, self.layout.data_world)

    def steps(self, epoch: int) -> list:
        return batching.epoch_steps(
            len(self.rows), rows_per_step=self.rows_per_step, micro_batch_size=self.stage.micro_batch_size,
            rank=self.layout.data_rank, world_size=self.layout.data_world, seed=self.stage.seed, epoch=epoch,
            lengths=self.lengths, token_budget=self.budget)

    def eval_micro_batches(self) -> list:
        return batching.eval_micro_batches(
            len(self.rows), micro_batch_size=self.stage.micro_batch_size, rank=self.layout.data_rank,
            world_size=self.layout.data_world, lengths=self.lengths, token_budget=self.budget)

    def batch(self, micro) -> Batch:
        """This process's micro batch (its part of each line, where processes share sequences)."""
        from stages import sequence_parallel

        rows = [self.rows[i] for i in micro.rows]
        built = packed_batch(rows, self.pad_id, self.flat) if self.budget else padded_batch(rows, self.pad_id)
        return sequence_parallel.shard(built.to(self.ctx.device))

    def trained_in(self, rows) -> int:
        """Trained tokens of these rows (a step's: the normaliser of per-token means)."""
        return sum(self.trained[i] for i in rows)
