"""RL stages: the objective's schema, the rollout's independence of the process count (real
DeepSpeed, 1 vs 2 processes), and whole stages through `python -m pipeline run` on the tiny task."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from core.schemas.ppo import PPOStage
from stages import compat
from stages.distributed import free_port
from tests.conftest import REPO, read_metrics, read_result, run_cli, tiny_pipeline, write_pipeline

DIGITS = {"path": "builtin:digits", "eval_split": "eval"}


def rl_stage(name, **knobs):
    return {
        "name": name, "kind": "ppo", "from": "sft", "data": DIGITS,
        "rollout_batch_size": 8, "n_samples_per_prompt": 2, "micro_rollout_batch_size": 16,
        "max_new_tokens": 8, "max_steps": 4, "eval_prompts": 16, "learning_rate": 1e-4, **knobs,
    }


def ppo_spec(**knobs) -> PPOStage:
    return PPOStage.model_validate({"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": DIGITS,
                                    "reward": {"rules": [{"rule": "exact_match"}]}, **knobs})


# --------------------------------------------------------------------------- the objective's schema


def test_the_default_objective_is_grpo_with_dapos_loss():
    spec = ppo_spec()
    assert (spec.advantage, spec.scale_rewards, spec.n_samples_per_prompt) == ("grpo", "group", 8)
    assert (spec.loss_aggregation, spec.importance_sampling) == ("token_mean", "token")
    assert (spec.clip_eps_low, spec.clip_eps_high) == (0.2, 0.28)
    assert ppo_spec(advantage="gae").n_samples_per_prompt == 1


def test_clip_eps_is_the_symmetric_shorthand_and_cannot_be_mixed_with_the_bounds():
    spec = ppo_spec(clip_eps=0.1)
    assert (spec.clip_eps_low, spec.clip_eps_high) == (0.1, 0.1)
    assert spec == ppo_spec(clip_eps_low=0.1, clip_eps_high=0.1)  # one objective, one spec (and hash)
    with pytest.raises(ValueError, match="clip_eps is the symmetric shorthand .* give it or clip_eps_high, not both"):
        ppo_spec(clip_eps=0.1, clip_eps_high=0.3)


def test_objective_fields_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="scale_rewards applies to advantage grpo, not rloo"):
        ppo_spec(advantage="rloo", scale_rewards="none")
    with pytest.raises(ValueError, match="dynamic_sampling drops prompts .* n_samples_per_prompt to 2 or more"):
        ppo_spec(advantage="gae", dynamic_sampling=True)
    with pytest.raises(ValueError, match="loss_aggregation"):
        ppo_spec(loss_aggregation="mean")


def test_only_a_kl_term_needs_the_reference_model():
    assert ppo_spec().needs_reference and ppo_spec(kl_coef=0.01, kl_target=0.1).needs_reference
    assert not ppo_spec(kl_coef=0).needs_reference
    # The adaptive controller scales kl_coef: from 0 it could never start.
    with pytest.raises(ValueError, match="kl_target adapts kl_coef by scaling it, so from kl_coef 0 it stays 0"):
        ppo_spec(kl_coef=0, kl_target=0.1)


# --------------------------------------------------------------------------- 1 vs 2 processes


def _probe(workdir, world: int) -> list[subprocess.Popen]:
    port = free_port()
    out = workdir / f"probe-{world}.pt"
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        probe = [sys.executable, str(REPO / "tests" / "ppo_probe.py"), str(workdir), str(out)]
        processes.append(subprocess.Popen(probe, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    return processes


@pytest.mark.slow
@pytest.mark.e2e
def test_one_and_two_processes_give_the_same_advantages_and_the_same_first_update(tmp_path):
    # The same rollout (fixed completions) on 1 process (micro batches of 4, 4 per step) and on 2
    # (8 sequences each, 2 micro batches per step). Tolerances: advantages, log-probs and the loss
    # 1e-6 (float32 log-probs from differently padded passes; the statistics are float64 sums); the
    # step's gradient 1e-6 x its largest entry; the update (AdamW's first step, lr g / (|g| + 1e-8),
    # lr 1e-3) 1e-7 wherever |g| > 1e-5: closer to 0 float32 noise in g decides Adam's step.
    (tmp_path / "builtin").mkdir()
    running = {world: _probe(tmp_path, world) for world in (1, 2)}
    for world, processes in running.items():
        for process in processes:
            output, _ = process.communicate(timeout=600)
            assert process.returncode == 0, f"{world} process(es):\n{output[-3000:]}"
    one, two = (torch.load(tmp_path / f"probe-{w}.pt", weights_only=False) for w in (1, 2))
    assert one["held"] == [16] and two["held"] == [8, 8]
    assert one["gradient_accumulation"] == 4 and two["gradient_accumulation"] == 2
    assert one["sequences"].keys() == two["sequences"].keys() and len(one["sequences"]) == 16
    for key, seq in one["sequences"].items():
        other = two["sequences"][key]
        assert seq["tokens"] == other["tokens"], key
        for field in ("advantages", "grpo_batch", "old_logprobs"):
            torch.testing.assert_close(torch.tensor(other[field]), torch.tensor(seq[field]), atol=1e-6, rtol=0)
    advantages = torch.tensor([a for seq in one["sequences"].values() for a in seq["advantages"]], dtype=torch.float64)
    assert abs(advantages.mean()) < 1e-5 and abs(advantages.std() - 1) < 1e-3  # whitened over the whole rollout
    assert one["trained"]["policy_loss"] == pytest.approx(two["trained"]["policy_loss"], abs=1e-6)
    largest = max(g.abs().max().item() for g in one["gradient"].values())
    compared = total = 0
    for name, gradient in one["gradient"].items():
        torch.testing.assert_close(two["gradient"][name], gradient, atol=1e-6 * largest, rtol=0, msg=name)
        clear = gradient.abs() > 1e-5
        torch.testing.assert_close(two["update"][name][clear], one["update"][name][clear], atol=1e-7, rtol=0, msg=name)
        compared, total = compared + int(clear.sum()), total + gradient.numel()
    assert compared > 0.8 * total and largest > 1e-2  # a real step, compared on most weights
    # A reward rule failing on the last prompt (the second process's) stops every process with its message.
    index, prompt = one["last_prompt"]
    assert two["reward_failure"] == one["reward_failure"] * 2 == [
        f"reward function probe:fails failed on train row {index} (prompt {prompt!r}): KeyError: 'answer'"] * 2


# --------------------------------------------------------------------------- whole stages


@pytest.mark.slow
@pytest.mark.e2e
def test_sft_rm_ppo_with_the_reward_model_as_the_reward_runs_logs_and_exports_its_critic(workdir):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationMixin

    # The ZeRO-3 stage samples with continuous batching where transformers has it; the other with
    # auto, which on a CPU is padded. The ZeRO-3 stage is DAPO in full, without a KL term: it loads
    # no reference model.
    sampler = "continuous" if compat.continuous_batching_available(GenerationMixin, zero_stage=3) else "padded"
    spec = tiny_pipeline(stages=[
        {"name": "sft", "kind": "sft", "model": "builtin:tiny-llama", "data": DIGITS, "max_steps": 30},
        {"name": "rm", "kind": "rm", "from": "sft", "data": DIGITS, "max_steps": 20},
        rl_stage("ppo", advantage="gae", reward={"model": "rm"}, reward_offload=True),
        rl_stage("grpo_zero3", advantage="grpo", zero_stage=3, dynamic_sampling=True, dynamic_sampling_max_rounds=2,
                 generation=sampler, kl_coef=0,
                 importance_sampling="sequence",
                 loss_aggregation="sequence_mean",
                 # rules decide (discrete rewards: some groups all alike); the RM still scores, weight 0
                 reward={"model": "rm", "model_weight": 0.0,
                         "rules": [{"rule": "exact_match"},
                                   {"rule": "overlong_penalty", "options": {"max_len": 8, "buffer": 2}}]}),
    ])
    result = run_cli("run", write_pipeline(workdir, spec), cwd=workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = workdir / "runs" / "t"
    for name, engine, reference in (("ppo", "padded", "live"), ("grpo_zero3", sampler, None)):
        outcome = read_result(runs / name)
        assert {"initial_reward", "final_reward"} <= set(outcome) and outcome["generation"] == engine
        assert outcome["reference"] == reference, name  # null: no reference model was loaded
        rollouts = [m for m in read_metrics(runs / name) if "rollout" in m]
        assert rollouts, name
        for key in ("reward", "approx_kl", "entropy", "clip_fraction", "response_length", "generate_s", "score_s",
                    "train_s"):
            assert key in rollouts[-1], (name, key)
        assert ("kl" in rollouts[-1]) == (reference is not None), name  # KL to a reference only with one
        for phase in ("generate", "score", "train"):
            assert rollouts[-1][f"{phase}_tokens_per_s"] > 0, (name, phase)
        assert 0 < rollouts[-1]["train_token_efficiency"] <= 1
        AutoModelForCausalLM.from_pretrained(runs / name / "model")
    assert "value_loss" in [m for m in read_metrics(runs / "ppo") if "rollout" in m][-1]
    # Where the time went: the ZeRO-3 stage gathered its actor around each generation, the other moved its
    # offloaded reward model (on a CPU a move to the same device, but timed all the same); each part of its phase.
    for name, part, phase in (("grpo_zero3", "gather_s", "generate_s"), ("ppo", "offload_s", "score_s")):
        for m in [m for m in read_metrics(runs / name) if "rollout" in m]:
            assert 0 < m[part] < m[phase], (name, part)
    last = [m for m in read_metrics(runs / "grpo_zero3") if "rollout" in m][-1]
    assert {"reward_reward_model", "reward_overlong_penalty"} <= set(last)
    sampling = [m for m in read_metrics(runs / "grpo_zero3") if "rollout" in m]
    assert all(m["groups_kept"] + m["groups_filled"] == 8 and 1 <= m["sampling_rounds"] <= 2 for m in sampling)
    assert sum(m["groups_dropped"] for m in sampling) > 0  # groups whose samples all got the same reward
    assert not (runs / "grpo_zero3" / "critic").exists()
    # Without a reference it still trains: the policy moved away from the SFT model it started from.
    trained, start = (AutoModelForCausalLM.from_pretrained(runs / n / "model") for n in ("grpo_zero3", "sft"))
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))

    # The critic of the gae run reloads as a 1-label classifier and scores like the trained one.
    critic = AutoModelForSequenceClassification.from_pretrained(runs / "ppo" / "critic")
    assert critic.config.num_labels == 1 and critic.config.pad_token_id is not None
    tokenizer = AutoTokenizer.from_pretrained(runs / "ppo" / "critic")
    batch = tokenizer(["sort 3142 = 1234</s>", "sort 3142 = 3142</s>"], return_tensors="pt", padding=True)
    with torch.no_grad():
        values = critic(**batch).logits.squeeze(-1)
    initial = AutoModelForSequenceClassification.from_pretrained(runs / "rm" / "model")  # where the critic started
    with torch.no_grad():
        assert not torch.allclose(values, initial(**batch).logits.squeeze(-1))  # it trained

