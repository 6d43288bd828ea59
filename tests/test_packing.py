"""Packing: which rows go where (pure), and that a packed batch is the same function of
the data as a padded one (a real tiny Llama, through the loading path the stages use).

Tolerances: fp32 on CPU; packed and padded run the same arithmetic on different
tensor shapes, so results agree to float rounding (rtol 1e-5, atol 1e-6 for
log-probs and gradients)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from core import batching, tiny
from core.config import DataSpec
from core.schemas.sft import SFTStage
from stages import compat, data, models, packed_attention, pretrained
from stages.losses import reward_pair_loss, token_logprobs

TOL = dict(rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the plan


def skewed_lengths(n, seed=0, median=400, cap=2048):
    rng = random.Random(seed)
    return [max(8, min(cap, int(rng.lognormvariate(math.log(median), 0.8)))) for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_packed_steps_take_every_row_of_the_step_once_in_equal_pass_counts(world):
    lengths = skewed_lengths(200)
    per_rank = [batching.epoch_steps(200, rows_per_step=48, micro_batch_size=4, rank=r, world_size=world, seed=3,
                                     epoch=0, lengths=lengths, token_budget=4 * 2048) for r in range(world)]
    assert all(len(steps) == 200 // 48 for steps in per_rank)
    for k in range(200 // 48):
        steps = [s[k] for s in per_rank]
        assert len({len(s.micro_batches) for s in steps}) == 1  # ZeRO's lockstep
        counted = [i for s in steps for m in s.micro_batches if m.weight for i in m.rows]
        assert sorted(counted) == sorted(steps[0].rows)
        for s in steps:
            for m in s.micro_batches:
                assert m.weight == 0 or sum(lengths[i] for i in m.rows) <= 4 * 2048 or len(m.rows) == 1


def test_packing_gives_processes_about_the_same_number_of_tokens():
    lengths = skewed_lengths(64, seed=5)
    shares = batching.pack_rows(list(range(64)), lengths, world_size=4, token_budget=4096)
    tokens = [sum(lengths[i] for m in mine if m.weight for i in m.rows) for mine in shares]
    assert max(tokens) - min(tokens) <= max(lengths)


def test_padded_steps_split_rows_round_robin_as_before():
    steps = batching.epoch_steps(103, rows_per_step=16, micro_batch_size=4, rank=1, world_size=2, seed=1, epoch=0)
    order = batching.shuffled(103, 1, 0)
    assert len(steps) == 6  # 103 // 16; the ragged tail is dropped
    assert [m.rows for m in steps[0].micro_batches] == [tuple(order[4:8]), tuple(order[12:16])]
    assert batching.epoch_steps(103, rows_per_step=16, micro_batch_size=4, rank=1, world_size=2, seed=1,
                                epoch=1)[0] != steps[0]  # a new order each epoch


@pytest.mark.parametrize("packed", [False, True])
def test_eval_micro_batches_cover_every_row_once_with_equal_counts_per_rank(packed):
    lengths = skewed_lengths(11, seed=2)
    budget = 2048 if packed else None
    per_rank = [batching.eval_micro_batches(11, micro_batch_size=2, rank=r, world_size=3, lengths=lengths,
                                            token_budget=budget) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1
    assert sorted(i for batches in per_rank for m in batches if m.weight for i in m.rows) == list(range(11))


def test_lines_of_a_packed_batch_waste_at_most_three_percent_on_the_digits_and_a_skewed_mix():
    rng = random.Random(0)
    for lengths, line in [([rng.randint(17, 23) for _ in range(16)], 48), (skewed_lengths(20, seed=9), 2048)]:
        lines = batching.pack_lines(lengths, line)
        width = max(sum(lengths[i] for i in ln) for ln in lines)
        assert sorted(i for ln in lines for i in ln) == list(range(len(lengths)))
        assert sum(lengths) / (len(lines) * width) >= 0.97


# --------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return tiny.materialize("tiny-llama", tmp_path_factory.mktemp("builtin"))


def load(folder, attention, auto_class=None, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model, _ = pretrained.from_pretrained(auto_class or AutoModelForCausalLM, str(folder), torch.float32, attention,
                                          48, **overrides)
    return model.eval()


def sft_rows(tokenizer, n=7, seed=1):
    rng = random.Random(seed)
    spec = DataSpec(path="builtin:digits")
    return [data.tokenize_sft(tiny.digits_row(rng) | {"response": tiny.digits_row(rng)["demo"]}, tokenizer, spec, 48)
            for _ in range(n)]


def pair_rows(tokenizer, n=5, seed=2):
    rng = random.Random(seed)
    return [data.tokenize_pair(tiny.digits_row(rng), tokenizer, DataSpec(path="builtin:digits"), 48) for _ in range(n)]


def sequence_logps(model, batch):
    logps = token_logprobs(batch.forward(model).logits, batch.input_ids, batch.loss_mask)
    return batch.per_sequence(logps)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("flat", [False, True], ids=["lines", "one-line"])
def test_packed_and_padded_give_the_same_log_probs_and_gradients(tiny_model_dir, attention, flat):
    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    rows = sft_rows(tokenizer)
    padded = data.padded_batch(rows, tokenizer.pad_token_id)
    packed = data.packed_batch(rows, tokenizer.pad_token_id, flat)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]  # several sequences share a line

    results = []
    for batch in (padded, packed):
        model = load(tiny_model_dir, attention)
        with batch.apart():
            logps = sequence_logps(model, batch)
            # The SFT loss: summed token NLL over the trained tokens of the batch.
            (-logps.sum() / batch.loss_mask[:, 1:].sum()).backward()
        results.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logps_padded, grads_padded), (logps_packed, grads_packed) = results
    torch.testing.assert_close(logps_packed, logps_padded, **TOL)
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_packed[name], grad, **TOL, msg=name)


def rm_loss(model, batch, pad_id):
    with models.output_of(models.score_head(model)) as scores:
        batch.forward(model)
    rewards = scores.value.squeeze(-1).reshape(-1)[batch.last_tokens(skip_id=pad_id)]
    return reward_pair_loss(rewards[0::2], rewards[1::2]).mean()


def dpo_loss_against_a_fixed_reference(model, batch, pad_id):
    from stages.losses import dpo_loss

    logps = sequence_logps(model, batch)
    reference = torch.linspace(-30, -10, len(logps))  # any fixed numbers: the reference is frozen
    return dpo_loss(logps[0::2], logps[1::2], reference[0::2], reference[1::2], beta=0.1)[0].mean()


@pytest.mark.parametrize("layout", ["shared-lines", "a-line-each"])
def test_gradient_checkpointing_recomputes_packed_attention_on_autograd_s_own_thread(tiny_model_dir, layout):
    """On a GPU, autograd runs backward, and checkpointing's recomputed forward, on a device
    thread of its own. The recomputation must keep the packed sequences apart as the forward
    did: here backward runs on another thread, and the gradients still equal the padded ones.
    (a-line-each: full lines of one sequence, where transformers 5's own mask would differ.)"""
    import threading

    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    rows = sft_rows(tokenizer)
    if layout == "a-line-each":
        rows = [{k: v[:16] for k, v in r.items()} for r in rows if len(r["input_ids"]) >= 16]
    grads = []
    packed = data.packed_batch(rows, tokenizer.pad_token_id, False)
    # Rows of equal length get a line each; rows of different lengths share lines.
    assert (packed.input_ids.shape[0] == len(rows)) == (layout == "a-line-each")
    for batch in (data.padded_batch(rows, tokenizer.pad_token_id), packed):
        model = load(tiny_model_dir, "sdpa")
        model.train()
        compat.enable_checkpointing(model)
        failures = []

        def backward(loss, failures=failures):
            try:
                loss.backward()
            except Exception as err:  # noqa: BLE001 -- reported below, in the test's thread
                failures.append(err)

        with batch.apart():
            loss = -sequence_logps(model, batch).sum() / batch.loss_mask[:, 1:].sum()
            worker = threading.Thread(target=backward, args=(loss,))
            worker.start()
            worker.join()
        assert not failures, failures
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, **TOL, msg=name)


@pytest.mark.parametrize("kind", ["rm", "dpo"])
def test_packed_and_padded_pairs_give_the_same_loss_and_gradients(tiny_model_dir, kind):
    from transformers import AutoModelForSequenceClassification

    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    rows = pair_rows(tokenizer, n=6)
    results = []
    for batch in (data.padded_batch(rows, tokenizer.pad_token_id),
                  data.packed_batch(rows, tokenizer.pad_token_id, False)):
        if kind == "rm":
            model = load(tiny_model_dir, "sdpa", AutoModelForSequenceClassification, num_labels=1)
            model.config.pad_token_id = tokenizer.pad_token_id
            loss_of = rm_loss
        else:
            model = load(tiny_model_dir, "sdpa")
            loss_of = dpo_loss_against_a_fixed_reference
        with batch.apart():
            loss = loss_of(model, batch, tokenizer.pad_token_id)
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_padded, grads_padded), (loss_packed, grads_packed) = results
    torch.testing.assert_close(loss_packed, loss_padded, **TOL)
    assert set(grads_packed) == set(grads_padded)
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_packed[name], grad, **TOL, msg=name)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_one_packed_sequence_cannot_see_another(tiny_model_dir, attention):
    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    rows = sft_rows(tokenizer, n=4)
    model = load(tiny_model_dir, attention)
    before = sequence_logps(model, data.packed_batch(rows, tokenizer.pad_token_id, True))
    changed = [dict(r) for r in rows]
    changed[0]["input_ids"] = [(t + 7) % 40 + 4 for t in changed[0]["input_ids"]]  # another first sequence
    after = sequence_logps(model, data.packed_batch(changed, tokenizer.pad_token_id, True))
    assert not torch.allclose(before[0], after[0])
    torch.testing.assert_close(after[1:], before[1:], **TOL)


def test_without_the_mask_packed_sequences_would_see_each_other(tiny_model_dir):
    """The test above can fail: outside `apart()` the same packed line mixes sequences."""
    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    rows = sft_rows(tokenizer, n=4)
    model = load(tiny_model_dir, "sdpa")
    batch = data.packed_batch(rows, tokenizer.pad_token_id, True)
    apart = sequence_logps(model, batch)
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
    with packed_attention.sequences_apart(None):
        logits = model(**inputs, attention_mask=torch.ones_like(batch.input_ids)).logits
    mixed = batch.per_sequence(token_logprobs(logits, batch.input_ids, batch.loss_mask))
    assert not torch.allclose(mixed[1:], apart[1:], rtol=1e-3, atol=1e-4)


def test_packed_rewards_are_what_the_exported_classifier_reads(tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    rows = pair_rows(tokenizer)
    model = load(tiny_model_dir, "sdpa", AutoModelForSequenceClassification, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        torch.nn.init.normal_(model.score.weight)
    packed = data.packed_batch(rows, tokenizer.pad_token_id, False)
    with models.output_of(models.score_head(model)) as scores:
        packed.forward(model)
    rewards = scores.value.squeeze(-1).reshape(-1)[packed.last_tokens(skip_id=tokenizer.pad_token_id)]
    padded = data.padded_batch(rows, tokenizer.pad_token_id)
    pooled = padded.forward(model).logits.squeeze(-1)  # transformers' own choice of token
    torch.testing.assert_close(rewards, pooled, **TOL)
    assert reward_pair_loss(rewards[0::2], rewards[1::2]).shape == (len(rows),)


def test_packed_pairs_keep_chosen_and_rejected_matched(tiny_model_dir):
    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    rows = pair_rows(tokenizer, n=6)
    model = load(tiny_model_dir, "eager")
    with torch.no_grad():
        packed = sequence_logps(model, data.packed_batch(rows, tokenizer.pad_token_id, False))
        one_by_one = torch.cat([sequence_logps(model, data.padded_batch([r], tokenizer.pad_token_id)) for r in rows])
    torch.testing.assert_close(packed, one_by_one, **TOL)  # [c0, r0, c1, r1, ...]


def test_token_budget_defaults_to_what_a_padded_micro_batch_holds():
    def stage(**knobs):
        return SFTStage.model_validate({"name": "s", "kind": "sft", "model": "builtin:tiny-llama",
                                        "data": {"path": "builtin:digits"}, **knobs})

    assert batching.token_budget(stage(micro_batch_size=4, max_len=2048), sequences_per_row=2) == 4 * 2048 * 2
    assert batching.token_budget(stage(micro_batch_tokens=5000, max_len=2048), sequences_per_row=2) == 5000


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def packed_and_padded(tmp_path_factory):
    """SFT packed and padded through `python -m pipeline run` (DeepSpeed, 2 processes). DPO's
    pair is in tests/test_preference.py; RM's loss and gradients are compared above."""
    from tests.conftest import run_cli, tiny_pipeline, write_pipeline

    workdir = tmp_path_factory.mktemp("packing")
    digits = {"path": "builtin:digits", "eval_split": "eval"}
    common = {"kind": "sft", "model": "builtin:tiny-llama", "data": digits, "max_steps": 20,
              "global_batch_size": 32, "learning_rate": 1e-3}
    stages = [{"name": "sft", **common}, {"name": "sft-padded", "packing": False, **common}]
    result = run_cli("run", write_pipeline(workdir, tiny_pipeline(stages=stages)), cwd=workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir / "runs" / "t"


@pytest.mark.slow
@pytest.mark.e2e
def test_packing_does_not_change_the_sft_curve(packed_and_padded):
    from tests.conftest import read_metrics, read_result

    def curve(name):
        return {m["step"]: m["loss"] for m in read_metrics(packed_and_padded / name) if "loss" in m}

    packed, padded = curve("sft"), curve("sft-padded")
    assert sorted(packed) == sorted(padded) == [5, 10, 15, 20]
    for step in packed:
        assert packed[step] == pytest.approx(padded[step], rel=1e-4), step
    assert read_result(packed_and_padded / "sft")["final_eval_loss"] == pytest.approx(
        read_result(packed_and_padded / "sft-padded")["final_eval_loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.e2e
def test_packed_training_records_say_how_little_was_padding(packed_and_padded):
    from tests.conftest import read_metrics

    for name, floor in (("sft", 0.97), ("sft-padded", 0.0)):
        records = [m for m in read_metrics(packed_and_padded / name) if "loss" in m]
        assert all(0 < m["token_efficiency"] <= 1 for m in records)
        assert all(m["token_efficiency"] >= floor for m in records), name
        assert all(m["mfu"] is None and m["gpu_mem_peak_gib"] is None for m in records)  # CPU: no meaning
    padded = [m["token_efficiency"] for m in read_metrics(packed_and_padded / "sft-padded") if "loss" in m]
    assert max(padded) < 0.97  # the digits are short and uneven: padding shows
