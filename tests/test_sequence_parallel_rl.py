"""Sequence parallelism in RL (stages/rollout.py, stages/ppo.py): processes that share each
sequence train what one process trains on the same rollouts.

Two RL stages scored by a reward model and exact_match, with a reference: GRPO, and PPO with a
critic (gae, the critic starting from the reward model), each run three ways as
tests/test_sequence_parallel.py runs sft, rm and dpo (1 process; 2 sharing; 2x2). Their reward
model is, for every layout, the 1-process run's rm stage (copied in: a finished stage of the same
spec is skipped), so the RL stages compare their own passes, not the rm stage's rounding, which
that file's comparison bounds: the critic's value loss and the KL of gae's second rollout magnify
the rm stage's ~3e-5 differences in score to ~3e-4.

Their completions are fixed per prompt and sample (tests/fixed_samples.py: sampling draws from
each process's own generator, so what it draws depends on the layout); everything else is ppo's
own code: each process of a group samples its share of the group's prompts and the group gathers
them, then the scoring passes (actor, reference, critic, reward model) and the training passes
run shared, with gradient checkpointing. Every reward, loss, gradient norm, KL and held-out reward
of both rollouts must agree; a GRPO whose shards run at the wrong positions must not. Without the
group's gather the processes of a group would hold different sequences: their exchanges would mix
lines of different samples (or of different widths, and fail), and the rewards, advantages and
losses would be those of one process's samples only.
"""

from __future__ import annotations

import json
import shutil

import pytest

from core.config import load_pipeline
from core.errors import InvalidInput
from tests.conftest import plugins_importable, write_pipeline
from tests.sharing_support import (
    LAYOUTS,
    agreeing_with_one_process,
    disagreements,
    load_pipeline_of,
    needs_the_stack,
    ran,
    sharing_pipeline,
)

RL_STAGES = ("grpo", "gae")


def rl_stages(names=RL_STAGES, kind="ppo_fixed_samples") -> list[dict]:
    """GRPO (2 samples of 4 prompts a rollout) and PPO with a critic (8 prompts), 2 rollouts of one
    optimizer step each, rewarded by exact_match and the reward model of the pipeline's rm stage,
    with a reference; gradient checkpointing, so the backward recomputes shared passes."""
    rl = {"kind": kind, "model": "builtin:tiny-llama", "data": {"path": "builtin:digits", "eval_split": "eval"},
          "gradient_checkpointing": True,
          "max_steps": 2, "micro_batch_size": 4, "global_batch_size": 8, "micro_rollout_batch_size": 4,
          "max_new_tokens": 8, "eval_prompts": 4, "kl_coef": 0.05, "allow_weak_reward_model": True,
          "reward": {"rules": [{"rule": "exact_match"}], "model": "rm", "normalize": False}}
    shapes = {"grpo": {"advantage": "grpo", "n_samples_per_prompt": 2, "rollout_batch_size": 4},
              "gae": {"advantage": "gae", "rollout_batch_size": 8}}
    return [{**rl, "name": name if kind == "ppo_fixed_samples" else f"{name}_misaligned", **shapes[name]}
            for name in names]


@pytest.fixture(scope="module")
def rl_layouts(tmp_path_factory):
    """{(processes, sequence_parallel): the pipeline's run folder} of the three runs of rm, grpo and
    gae (and in the 2-process one a misaligned grpo, tests/misaligned_shards.py); the rm stage
    trains in the 1-process run and is copied into the others."""
    out = {}
    with plugins_importable():
        for processes, share in LAYOUTS:
            workdir = tmp_path_factory.mktemp(f"sprl{processes}x{share}")
            spec = sharing_pipeline(processes, share, ("rm",), name="sprl", plugins=["tests.misaligned_shards"])
            spec["stages"] += rl_stages()
            if (processes, share) == (2, 2):
                spec["stages"] += rl_stages(("grpo",), kind="ppo_misaligned")
            if out:
                shutil.copytree(out[1, 1] / "rm", workdir / "runs" / "sprl" / "rm")
            out[processes, share] = ran(workdir, spec)
    return out


@needs_the_stack
@pytest.mark.e2e
@pytest.mark.parametrize("layout", [(2, 2), (4, 2)], ids=["2-sharing", "2x2"])
@pytest.mark.parametrize("name", RL_STAGES)
def test_rl_sharing_sequences_trains_what_one_process_trains(rl_layouts, layout, name):
    metrics = agreeing_with_one_process(rl_layouts[1, 1] / name, rl_layouts[layout] / name, layout)
    rollouts = [r for r in metrics if "rollout" in r]
    assert [r["rollout"] for r in rollouts] == [1, 2]
    assert all(r["grad_norm"] > 0 and "reward_reward_model" in r for r in rollouts)
    assert rollouts[-1]["kl"] != 0  # the policy moved from the reference
    assert name != "gae" or all(r["critic_grad_norm"] > 0 for r in rollouts)


@needs_the_stack
@pytest.mark.e2e
def test_rl_shards_at_the_wrong_positions_do_not_match(rl_layouts):
    wrong = disagreements(rl_layouts[1, 1] / "grpo", rl_layouts[2, 2] / "grpo_misaligned")
    assert wrong, "the misaligned shards matched one process: the comparison cannot fail"


# --------------------------------------------------------------------------- what is refused


def test_an_rl_stage_splits_its_prompts_and_steps_over_the_groups():
    spec = sharing_pipeline(4, 2)
    spec["stages"] = [{"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
                       "reward": {"rules": [{"rule": "exact_match"}]}, "rollout_batch_size": 4,
                       "n_samples_per_prompt": 2, "micro_batch_size": 4, "global_batch_size": None}]
    stage = load_pipeline_of(spec).stages[0]  # 8 sequences a rollout: one step of 4 rows for each of 2 groups
    assert stage.data_parallel(4) == 2
    spec["stages"][0]["rollout_batch_size"] = 6  # 6 prompts cannot be sampled by 4 processes in equal shares
    with pytest.raises(InvalidInput) as err:
        load_pipeline_of(spec)
    assert "stages[0] (rl).rollout_batch_size: 6 prompts do not split evenly over 4 processes" in err.value.message


def test_the_reward_model_of_a_shared_rl_stage_must_split_its_heads_too(tmp_path):
    from pipeline import preflight
    from pipeline.hfcache import hf_cache

    folder = tmp_path / "three-heads"  # the reward model scores shared batches as the policy does
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 3, "vocab_size": 48, "max_position_embeddings": 64}))
    spec = sharing_pipeline(2, 2)
    spec["stages"] = [{"name": "rm", "kind": "rm", "model": str(folder), "data": {"path": "builtin:digits"},
                       "sequence_parallel": 1},
                      {"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
                       "rollout_batch_size": 8, "reward": {"model": "rm"}}]
    loaded = load_pipeline(str(write_pipeline(tmp_path, spec)))
    with pytest.raises(InvalidInput) as err:
        preflight.check_sequence_parallel(loaded, loaded.stages[1], "builtin:tiny-llama", "stages[1] (rl)",
                                          hf_cache(loaded), 2, stack_is_here=False)
    assert (f"stages[1] (rl).sequence_parallel: 2 does not divide the model's 3 attention heads (each process "
            f"takes 1/2 of them); on 2 processes no sharing fits the model: leave it at 1, or change the processes "
            f"(tasks_per_node, nodes) (model {folder}, the reward.model)") == err.value.message
