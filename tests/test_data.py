"""Tokenisation and loss masks (the data order: tests/test_packing.py)."""

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
