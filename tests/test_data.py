"""Tokenisation, loss masks and the data order."""

from __future__ import annotations

from pipeline.config import DataSpec
from stages import data, tiny


def test_sft_loss_mask_covers_the_response_and_eos_only():
    tokenizer = tiny.build_tokenizer()
    spec = DataSpec(path="builtin:digits")
    row = data.tokenize_sft({"prompt": "sort 21 =", "response": " 12"}, tokenizer, spec, max_len=64)
    learned = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert tokenizer.decode(learned) == " 12</s>"
    assert row["input_ids"][0] == tokenizer.bos_token_id and row["loss_mask"][0] == 0


def test_chat_rows_learn_every_assistant_turn_and_nothing_else():
    tokenizer = tiny.build_tokenizer()
    spec = DataSpec(path="builtin:digits", chat_template=True)
    messages = [
        {"role": "user", "content": "sort 21"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "sort 31"},
        {"role": "assistant", "content": "13"},
    ]
    row = data.tokenize_sft({"messages": messages}, tokenizer, spec, max_len=128)
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
    learned = "".join(tokenizer.decode([t]) for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    assert learned == "12</s>\n13</s>\n"


def test_truncation_keeps_ids_and_mask_aligned():
    tokenizer = tiny.build_tokenizer()
    row = data.tokenize_sft({"prompt": "sort 987654321 =", "response": " 123456789"}, tokenizer,
                            DataSpec(path="builtin:digits"), max_len=20)
    assert len(row["input_ids"]) == len(row["loss_mask"]) == 20


def test_micro_batches_split_an_epoch_between_ranks_without_overlap():
    rank0 = data.micro_batches(103, 4, rank=0, world_size=2, seed=1, epoch=0)
    rank1 = data.micro_batches(103, 4, rank=1, world_size=2, seed=1, epoch=0)
    seen = [i for b in rank0 + rank1 for i in b]
    assert len(rank0) == len(rank1) == 12  # 103 // 8 rounds; the ragged tail is dropped
    assert len(set(seen)) == len(seen) == 96
    assert data.micro_batches(103, 4, 0, 2, 1, 0) == rank0  # deterministic
    assert data.micro_batches(103, 4, 0, 2, 1, 1) != rank0  # a new order each epoch


def test_eval_batches_cover_every_row_once_with_equal_counts_per_rank():
    per_rank = [data.eval_batches(11, 2, rank, 3) for rank in range(3)]
    assert len({len(b) for b in per_rank}) == 1
    weighted = [i for batches in per_rank for idx, w in batches for i, x in zip(idx, w) if x]
    assert sorted(weighted) == list(range(11))


def test_the_digits_task_rejected_answers_are_wrong_and_chosen_are_right(tmp_path):
    import json

    folder = tiny.materialize("digits", tmp_path)
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert len(rows) == tiny.DIGITS_SPLITS["train"]
    for row in rows[:200]:
        assert tiny.digits_answer_is_correct(row["prompt"], row["chosen"])
        assert not tiny.digits_answer_is_correct(row["prompt"], row["rejected"])
    eval_prompts = {json.loads(l)["prompt"] for l in (folder / "eval.jsonl").read_text().splitlines()}
    assert not eval_prompts & {r["prompt"] for r in rows}
