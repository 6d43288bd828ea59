"""`make pipeline`: the shipped tiny chain SFT -> RM, DPO, RL, each reaching its bar."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import read_metrics, read_result

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def tiny_runs(tiny_chain):
    return tiny_chain.runs  # one run of the chain per session (tests/conftest.py)


def test_the_sft_stage_trains_packed_with_almost_no_padding(tiny_runs):
    records = [m for m in read_metrics(tiny_runs / "sft") if "loss" in m]
    assert records and all(m["token_efficiency"] >= 0.97 for m in records)


def test_sft_halves_the_eval_loss_and_generates(tiny_runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sft = read_result(tiny_runs / "sft")
    assert sft["final_eval_loss"] <= 0.5 * sft["initial_eval_loss"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_runs / "sft" / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny_runs / "sft" / "model")
    prompt = tokenizer("sort 5203 =", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=7, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    completion = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert completion.strip().rstrip(".") == "0235"  # the demonstrator's habit may add a period


def test_the_reward_model_ranks_held_out_pairs_and_reloads_as_a_classifier(tiny_runs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    assert read_result(tiny_runs / "rm")["eval_accuracy"] >= 0.9
    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_runs / "rm" / "model")
    assert reward_model.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_runs / "rm" / "model")
    batch = tokenizer(["sort 3142 = 1234</s>", "sort 3142 = 3142</s>"], return_tensors="pt", padding=True)
    with torch.no_grad():
        chosen, rejected = reward_model(**batch).logits.squeeze(-1).tolist()
    assert chosen > rejected
    assert json.loads((tiny_runs / "rm" / "model" / "reward_stats.json").read_text())["std"] > 0


def test_dpo_starts_at_log_2_and_prefers_held_out_chosen_answers(tiny_runs):
    from transformers import AutoModelForCausalLM

    dpo = read_result(tiny_runs / "dpo")
    # Policy == reference before DPO trains: every implicit reward is 0, the loss log 2.
    assert dpo["initial_eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert dpo["eval_reward_accuracy"] >= 0.9
    AutoModelForCausalLM.from_pretrained(tiny_runs / "dpo" / "model")


def test_rl_raises_the_held_out_exact_match_reward_by_a_quarter(tiny_runs):
    rl = read_result(tiny_runs / "rl")
    assert rl["initial_reward"] < 0.5  # the SFT model leaves room: it copies the stray period
    # 0.575 on the current stack, 2026-11-25 (issue 15: at least 0.5 with the default objective)
    assert rl["final_reward"] >= 0.5
