"""RL generation (stages/generation.py) and length-sorted micro batches (core/batching.py by_length).

The engines run on the built-in tiny Llama (random weights, CPU); continuous batching only where the
installed transformers has it. The sorted micro batches are checked against unsorted ones through
the stage's own policy objective (stages/ppo.py policy_objective) on the same model."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core import batching, tiny
from core.errors import InvalidInput
from stages import compat, generation, models
from stages.ppo import policy_objective, step_share
from stages.rollout import Rollout
from tests.test_ppo import ppo_spec

MAX_NEW = 8


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    folder = tiny.materialize("tiny-llama", tmp_path_factory.mktemp("builtin"))
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    return model, models.load_tokenizer(str(folder))


def prompts(tokenizer, n: int, seed: int = 0) -> list[SimpleNamespace]:
    rng = random.Random(seed)
    texts = [f"s: sort {''.join(rng.choice('0123456789') for _ in range(rng.randint(1, 9)))} =\na: " for _ in range(n)]
    return [SimpleNamespace(ids=tokenizer(t)["input_ids"]) for t in texts]


def sample(model, tokenizer, engine: str, batch, greedy: bool, decoding=None, **knobs) -> list[list[int]]:
    stage = ppo_spec(generation=engine, micro_rollout_batch_size=8, max_new_tokens=MAX_NEW, zero_stage=2, **knobs)
    return generation.generate(SimpleNamespace(module=model), batch, tokenizer=tokenizer, stage=stage, device="cpu",
                               greedy=greedy, decoding=decoding)


def assert_some_end_at_eos(responses, tokenizer) -> None:
    ended = [r for r in responses if len(r) < MAX_NEW]
    assert ended and all(r[-1] == tokenizer.eos_token_id for r in ended)  # some stop at eos, and are cut there


needs_continuous = pytest.mark.skipif(
    not compat.continuous_batching_available(__import__("transformers").GenerationMixin, zero_stage=2),
    reason="the installed transformers has no continuous batching (the pinned 4.38 stack): padded only")


# --------------------------------------------------------------------------- engines


def test_auto_samples_padded_on_a_cpu_and_continuous_is_refused_where_transformers_lacks_it():
    no_batching = SimpleNamespace()  # a model class without init_continuous_batching, as on transformers 4.38
    assert generation.engine_for(ppo_spec(), no_batching, "cpu") == "padded"
    assert generation.engine_for(ppo_spec(generation="padded"), no_batching, "cuda") == "padded"
    with pytest.raises(InvalidInput, match="generation: continuous needs"):
        generation.engine_for(ppo_spec(generation="continuous"), no_batching, "cpu")


def test_a_response_is_cut_after_its_first_eos():
    assert generation.cut_at_eos([5, 7, 2, 9, 2], eos_id=2) == [5, 7, 2]
    assert generation.cut_at_eos([5, 7, 9], eos_id=2) == [5, 7, 9]


@needs_continuous
def test_continuous_greedy_completions_equal_padded_greedy_ones(tiny_lm):
    model, tokenizer = tiny_lm
    # 20 requests, 8 in flight at once: finished ones make room for waiting ones. With these prompts
    # (seed 3) the random model ends one completion early with eos.
    batch = prompts(tokenizer, 20, seed=3)
    padded = sample(model, tokenizer, "padded", batch, greedy=True)
    continuous = sample(model, tokenizer, "continuous", batch, greedy=True)
    assert continuous == padded
    assert all(0 < len(r) <= MAX_NEW for r in continuous)
    assert_some_end_at_eos(continuous, tokenizer)


# --------------------------------------------------------------------------- what auto picks, by the records

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("device", sorted(generation.AUTO_ENGINE))
def test_auto_engine_table_follows_its_benchmark_records(device):
    decision = generation.AUTO_ENGINE[device]
    other = {"padded": "continuous", "continuous": "padded"}[decision.engine]
    for name in decision.records:
        record = json.loads((REPO / name).read_text())
        assert record["machine"]["device"] == device, name
        for mode in ("sampling", "greedy"):  # the engine chosen was the faster, best and median
            chosen, rival = (record["generation"][f"{e}/{mode}"] for e in (decision.engine, other))
            assert chosen["tokens_per_s_best"] > rival["tokens_per_s_best"], (name, mode)
            assert chosen["tokens_per_s_median"] > rival["tokens_per_s_median"], (name, mode)
        sampled = [record["generation"][f"{e}/sampling"]["tokens_per_s_best"] for e in ("padded", "continuous")]
        assert all(f"{figure:,.0f}" in decision.figures for figure in sampled), name  # the figures quoted are its own
    readme = (REPO / "README.md").read_text()
    assert all(Path(name).name in readme for name in decision.records)  # README's RL section cites them


def test_auto_follows_the_recorded_decision_where_both_engines_exist():
    with_batching = SimpleNamespace(init_continuous_batching=lambda **_: None)  # as a 5.x model has it
    for device, decision in generation.AUTO_ENGINE.items():
        assert generation.engine_for(ppo_spec(), with_batching, device) == decision.engine
    assert generation.AUTO_ENGINE["cuda"].engine == "padded"  # the H200 records: continuous 1.8-20x slower


# --------------------------------------------------------------------------- the static-cache padded path

needs_static = pytest.mark.skipif(compat.static_decoding_unavailable() is not None,
                                  reason="the installed transformers (pinned 4.38) decodes padded chunks with generate")


@needs_static
def test_static_cache_greedy_completions_equal_generates(tiny_lm):
    model, tokenizer = tiny_lm
    # Chunks of 8 (the last one 4) of prompts of 1-9 digits: left padding of different widths.
    batch = prompts(tokenizer, 20, seed=3)
    dynamic = sample(model, tokenizer, "padded", batch, greedy=True)
    static = sample(model, tokenizer, "padded", batch, greedy=True, decoding="static")
    assert static == dynamic
    assert_some_end_at_eos(static, tokenizer)


@pytest.mark.parametrize("engine, decoding", [pytest.param("continuous", None, marks=needs_continuous),
                                              pytest.param("padded", "static", marks=needs_static)])
def test_sampling_follows_the_torch_seed_and_the_sampling_settings(tiny_lm, engine, decoding):
    model, tokenizer = tiny_lm
    batch = prompts(tokenizer, 12)

    def drawn(seed, **knobs):
        torch.manual_seed(seed)
        return sample(model, tokenizer, engine, batch, greedy=False, decoding=decoding, **knobs)

    first = drawn(1)
    assert drawn(1) == first  # a resumed run, same random state: the same samples
    assert drawn(2) != first
    greedy = sample(model, tokenizer, engine, batch, greedy=True, decoding=decoding)
    assert first != greedy
    # Nucleus sampling with a tiny top_p keeps only the most likely token: greedy's completions.
    assert drawn(3, top_p=1e-6) == greedy


@needs_static
@pytest.mark.slow
@pytest.mark.skipif(not compat.zero3_hooks_liftable(), reason="the installed DeepSpeed cannot lift its ZeRO-3 hooks")
def test_a_zero3_actor_decodes_the_same_greedy_tokens_on_the_static_cache_with_its_hooks_lifted(tmp_path):
    from tests.test_compat import probe

    result, code, output = probe("static-zero3", tiny.materialize("tiny-llama", tmp_path), timeout=300)
    assert code == 0 and result is not None, output[-3000:]
    assert result["static"] == result["dynamic"] and len(result["static"]) == 9
    assert all(seconds > 0 for seconds in result["gather_s"].values())  # each way gathered, and timed it


def test_a_static_loop_that_fails_says_why_and_the_stage_decodes_with_generate_from_then_on(tiny_lm, monkeypatch,
                                                                                          caplog):
    model, tokenizer = tiny_lm
    batch = prompts(tokenizer, 6)

    def broken(*args, **kwargs):
        raise RuntimeError("a compile error, as a GPU might give")

    monkeypatch.setattr(generation, "static_padded", broken)
    monkeypatch.setattr(generation, "_static_broken", None)
    with caplog.at_level("WARNING", logger="stages"):
        fell_back = sample(model, tokenizer, "padded", batch, greedy=True, decoding="static")
    assert fell_back == sample(model, tokenizer, "padded", batch, greedy=True, decoding="dynamic")
    assert "static-cache decoding failed (RuntimeError: a compile error" in caplog.text
    assert generation.padded_decoding("cuda", zero_stage=2) == "dynamic"  # not tried again on a GPU


def test_a_gpu_decodes_padded_chunks_on_a_static_cache_where_transformers_has_one():
    missing = compat.static_decoding_unavailable()
    assert generation.padded_decoding("cpu", zero_stage=2) == "dynamic"
    assert generation.padded_decoding("cuda", zero_stage=2) == ("static" if missing is None else "dynamic")
    # Under ZeRO-3 the static loop needs DeepSpeed to lift its per-forward hooks (each process stops on its own).
    liftable = missing is None and compat.zero3_hooks_liftable()
    assert generation.padded_decoding("cuda", zero_stage=3) == ("static" if liftable else "dynamic")
    if missing is not None:  # the pinned stack: said why, and asking for it by name is an error, not a fallback
        assert "transformers 4.38" in missing
        with pytest.raises(RuntimeError, match="static-cache decoding asked for"):
            generation.static_padded(None, [[1]], tokenizer=None, stage=ppo_spec(), device="cpu", greedy=True,
                                     compiled=False)


# --------------------------------------------------------------------------- length-sorted micro batches


LENGTHS = [9, 4, 12, 6, 4, 10]


def test_by_length_groups_rows_shortest_first_and_keeps_the_order_of_equal_lengths():
    assert batching.by_length(range(6), LENGTHS, 2) == [[1, 4], [3, 0], [5, 2]]
    assert batching.by_length([5, 0, 3], LENGTHS, 2) == [[3, 0], [5]]


def rollout_of(model, generator) -> Rollout:
    """Six sequences of LENGTHS: 3 prompt tokens, the rest response; old log-probs the model's own
    plus noise (ratios off 1, some clipped), random advantages."""
    sequences = [torch.randint(4, 40, (n,), generator=generator).tolist() for n in LENGTHS]
    masks = [[0] * 3 + [1] * (n - 3) for n in LENGTHS]
    width = max(LENGTHS) - 1
    mask = torch.zeros(len(LENGTHS), width)
    for i, n in enumerate(LENGTHS):
        mask[i, 2 : n - 1] = 1.0
    whole = Rollout(sequences, masks, mask, torch.zeros_like(mask), torch.zeros_like(mask), mask, torch.zeros(6),
                    torch.zeros_like(mask), None, None)
    with torch.no_grad():
        batch = whole.train_batch(range(6), 0, "cpu")
        from stages.rollout import logprobs_of

        own = logprobs_of(model, batch.tokens, 1.0)[0]
    noise = 0.3 * torch.randn(mask.shape, generator=generator)
    whole.old_logprobs = (own + noise) * mask
    whole.ref_logprobs = (own - noise) * mask
    whole.advantages = torch.randn(mask.shape, generator=generator) * mask
    return whole


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sequence_sum_normalized"])
def test_length_sorted_micro_batches_give_the_steps_loss_and_gradient_with_less_padding(tiny_lm, aggregation):
    model, _ = tiny_lm
    stage = ppo_spec(loss_aggregation=aggregation, kl_in_reward=False, kl_coef=0.1, max_new_tokens=MAX_NEW)
    rollout = rollout_of(model, torch.Generator().manual_seed(7))
    tokens, sequences = float(rollout.mask.sum()), float(rollout.mask.any(dim=1).sum())

    def step(micro):
        model.zero_grad()
        total, processed = 0.0, 0
        for rows in micro:
            batch = rollout.train_batch(rows, 0, "cpu")
            processed += batch.tokens.processed_tokens
            loss = policy_objective(model, batch, stage, stage.kl_coef, step_share(batch, stage, tokens, sequences))[0]
            loss.backward()
            total += loss.item()
        return total, [p.grad.clone() for p in model.parameters()], processed

    in_order = [[0, 1], [2, 3], [4, 5]]
    loss, grads, processed = step(in_order)
    sorted_loss, sorted_grads, sorted_processed = step(batching.by_length(range(6), LENGTHS, 2))
    assert sorted_loss == pytest.approx(loss, rel=1e-6, abs=1e-7)
    for a, b in zip(grads, sorted_grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads)
    # Padded tokens: in order 2*9 + 2*12 + 2*10 = 62; sorted (4,4) (6,9) (10,12): 2*4 + 2*9 + 2*12 = 50.
    assert (processed, sorted_processed) == (62, 50)
