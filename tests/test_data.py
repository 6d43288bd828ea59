"""Tokenisation and loss masks (the data order: tests/test_packing.py)."""

from __future__ import annotations

import json

import pytest

from core import tiny
from core.config import DataSpec
from core.errors import InvalidInput
from core.schemas.sft import SFTStage
from stages import data


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
    eval_prompts = {json.loads(line)["prompt"] for line in (folder / "eval.jsonl").read_text().splitlines()}
    assert not eval_prompts & {r["prompt"] for r in rows}


# --------------------------------------------------------------------------- truncation
# The tiny tokenizer has one token per character and puts <s> in front: prompt "ab" is
# [<s> a b], response "cd" is [c d </s>].


def counts(split):
    t = split.truncation
    return t.cut, t.dropped


def test_sft_rows_cut_by_max_len_are_counted_and_those_left_without_a_response_token_dropped():
    rows = [
        {"prompt": "ab", "response": "cd"},  # <s> a b c d </s>: 6 tokens, fits
        {"prompt": "abcd", "response": "ef"},  # 8 tokens: cut to <s> a b c d e, one response token left
        {"prompt": "abcde", "response": "f"},  # 8 tokens: cut to <s> a b c d e, all prompt
    ]
    split = data.tokenize(rows, "sft", tiny.build_tokenizer(), DataSpec(path="x.jsonl"), max_len=6)
    assert counts(split) == (2, 1)
    assert split.rows == rows[:2]
    assert [len(t["input_ids"]) for t in split.tokens] == [6, 6]
    assert [data.trained_tokens(t) for t in split.tokens] == [3, 1]


@pytest.mark.parametrize("max_len,expected", [(6, (0, 0)), (5, (1, 0)), (4, (1, 1))])
def test_a_pair_cut_until_chosen_and_rejected_are_the_same_tokens_is_dropped(max_len, expected):
    # <s> a b c d </s> against <s> a b c e </s>: they differ from the fifth token on.
    row = {"prompt": "ab", "chosen": "cd", "rejected": "ce"}
    for kind in ("rm", "dpo"):
        split = data.tokenize([row], kind, tiny.build_tokenizer(), DataSpec(path="x.jsonl"), max_len)
        assert counts(split) == expected
        assert len(split.tokens) == 1 - expected[1]


@pytest.mark.parametrize("max_len,expected", [(8, (0, 0)), (7, (1, 0)), (5, (1, 0)), (4, (1, 1))])
def test_a_ppo_prompt_is_cut_without_room_for_max_new_tokens_and_dropped_when_it_fills_max_len(max_len, expected):
    # <s> a b c: 4 tokens, plus 4 new ones.
    split = data.tokenize([{"prompt": "abc"}], "ppo", tiny.build_tokenizer(), DataSpec(path="x.jsonl"), max_len,
                          max_new_tokens=4)
    assert counts(split) == expected


def long_and_short_rows(path, short=8, long=2):
    # short: <s> a b c d </s> (6 tokens); long: an 11-token prompt + c d </s> (14 tokens)
    rows = [{"prompt": "ab", "response": "cd"}] * short + [{"prompt": "abcdefghij", "response": "cd"}] * long
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_stage(path, **knobs):
    return SFTStage(name="sft", kind="sft", model="builtin:tiny-llama", data={"path": str(path)}, **knobs)


def test_a_stage_that_max_len_cuts_more_than_the_allowed_share_is_refused_with_the_numbers(tmp_path):
    stage = sft_stage(long_and_short_rows(tmp_path / "rows.jsonl"), max_len=8)
    with pytest.raises(InvalidInput) as refused:
        data.tokenized_splits(stage, tiny.build_tokenizer(), tmp_path)
    message = refused.value.message
    assert message.startswith("stage sft: max_len 8 cuts 2 of 10 rows (20.0%), more than max_truncated_share (0.1)")
    # 1 of 10 rows may be cut: max_len must hold the 9th-shortest row, a long one.
    assert "Raise max_len to 14 or more (the longest row has 14 tokens)" in message


def test_within_the_allowed_share_rows_with_nothing_to_learn_are_dropped_and_counted(tmp_path):
    stage = sft_stage(long_and_short_rows(tmp_path / "rows.jsonl"), max_len=8, max_truncated_share=0.2)
    splits = data.tokenized_splits(stage, tiny.build_tokenizer(), tmp_path)
    record = splits.record()
    assert record["max_len"] == 8
    assert record["train"]["rows"] + record["eval"]["rows"] == 10
    assert record["train"]["cut"] + record["eval"]["cut"] == 2
    assert record["train"]["dropped"] + record["eval"]["dropped"] == 2
    assert len(splits.train.tokens) + len(splits.eval.tokens) == 8


def test_validate_measures_a_proportional_sample_of_large_data_and_says_so(tmp_path):
    stage = sft_stage(long_and_short_rows(tmp_path / "rows.jsonl", short=380, long=20), max_len=8)
    splits = data.tokenized_splits(stage, tiny.build_tokenizer(), tmp_path, sample=100)
    train, held_out = splits.train.truncation, splits.eval.truncation
    assert (train.rows, held_out.rows) == (380, 20)  # 5% held out
    assert (train.measured, held_out.measured) == (95, 5)
    assert "measured on a random 100 of 400 rows" in splits.summary("sft")


def test_a_stage_warns_in_its_log_when_evaluation_rows_are_training_rows(tmp_path, caplog):
    rows = [{"prompt": f"{n}", "response": "cd"} for n in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    eval_rows = rows[:4] + [{"prompt": "x", "response": "y"}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    stage = SFTStage(name="sft", kind="sft", model="builtin:tiny-llama",
                     data={"path": str(tmp_path / "train.jsonl"), "eval_split": str(tmp_path / "eval.jsonl")})
    with caplog.at_level("WARNING", logger="stages"):
        data.tokenized_splits(stage, tiny.build_tokenizer(), tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        "stage sft: eval rows 4 of 5 also appear in the training rows: the eval metrics measure memory, not "
        "generalisation. Evaluate on rows the stage does not train on"]
