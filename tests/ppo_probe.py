"""One RL rollout and its first optimizer step on the tiny model under real DeepSpeed (ZeRO-2,
gloo), in as many processes as the environment says (RANK, WORLD_SIZE, MASTER_ADDR/PORT).
tests/test_ppo.py runs it in 1 and in 2 processes and compares what rank 0 saves.

Everything is the stage's own code (stages/ppo.py, stages/rollout.py) except sampling: the
completions are fixed per (prompt, sample), so both runs train on the same rollout.

    python tests/ppo_probe.py WORKDIR OUT.pt
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

from core.config import PipelineSpec  # noqa: E402
from core.rewards import RewardError, RuleReward  # noqa: E402
from pipeline.graph import build_tasks  # noqa: E402
from stages import advantages as L  # noqa: E402
from stages import collectives, distributed, models, ppo, rollout, runner  # noqa: E402
from stages.rollout import Prompt  # noqa: E402

SAMPLES = 2


def pipeline(workdir: Path, world: int) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "name": "probe", "runs_dir": str(workdir / f"runs-{world}"),
        "cluster": {"executor": "local", "tasks_per_node": world},
        "stages": [{
            "name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
            "precision": "fp32", "zero_stage": 2, "max_len": 48, "max_new_tokens": 8, "learning_rate": 1e-3,
            "advantage": "reinforce_pp", "n_samples_per_prompt": SAMPLES, "rollout_batch_size": 8,
            "micro_batch_size": 4, "global_batch_size": 16, "micro_rollout_batch_size": 4,
            "reward": {"rules": [{"rule": "exact_match"}], "normalize": False}, "kl_coef": 0.05,
        }],
    })


def fixed_completions(actor, prompts, *, tokenizer, stage, device, greedy=False, clock=None):
    """The right answer for one sample of each prompt, with a stray '.' for the other: which
    one depends on the prompt, so groups differ and the rewards are 1 and 0."""
    out = []
    for position, prompt in enumerate(prompts):
        sample = position % SAMPLES
        text = " " + prompt.label + ("" if sample == prompt.index % SAMPLES else ".")
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    return out


def failing_reward(stage, ctx, rl_models, last: Prompt, mine: list) -> str:
    """What each process raises when a reward rule fails on the rollout's last prompt, which only the
    last process holds."""
    def fails(samples):
        return [1.0 if p != last.text else {}["answer"] for p in samples.prompts]

    maker = rollout.RolloutMaker(stage, ctx, rl_models, RuleReward([("probe:fails", fails, 1.0)]),
                                 generate_fn=fixed_completions)
    try:
        maker.score(mine, maker.generate(mine).ids)
    except RewardError as err:
        return err.message
    return "no error"


def main(workdir: Path, out: Path) -> None:
    env = distributed.detect()
    device = distributed.init(env, 0)
    task = build_tasks(pipeline(workdir, env.world_size))[0]
    ctx = runner.StageContext(task=task, folder=task.folder, builtin_root=workdir / "builtin", rank=env.rank,
                              world_size=env.world_size, device=device, on_gpu=False)
    runner._materialize_builtins(task, ctx)
    stage = task.stage
    torch.manual_seed(stage.seed)
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    prompts, _, _ = ppo.load_prompts(stage, ctx, tokenizer)
    ds_config = ctx.deepspeed_config(stage, model_path)
    schedule = ppo.schedule_of(stage, ctx.world_size, len(prompts))
    rl_models = ppo.load_models(task, ctx, model_path, tokenizer, ds_config, schedule.total_steps)
    maker = rollout.RolloutMaker(stage, ctx, rl_models, RuleReward.from_specs(stage.reward.rules),
                                 generate_fn=fixed_completions)
    mine = [prompts[i] for i in schedule.prompt_rows(0, 0, env.rank)]
    made = maker.make(lambda round_: mine, stage.kl_coef)
    # Another estimator on the same rollout: GRPO with the whole rollout's std.
    batch_scaled, _ = L.estimate_advantages(
        "grpo", L.AdvantageInputs(scores=made.scores, kl=made.kl, mask=made.mask, kl_coef=stage.kl_coef),
        L.AdvantageSettings(group_size=SAMPLES, scale_rewards="batch"), collectives.sum_once_per_group)

    actor = rl_models.actor
    before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    gradient = {}
    step = actor.step

    def step_keeping_the_gradient():  # the step's gradient over every process, before the optimizer uses it
        if actor.is_gradient_accumulation_boundary():
            gradient.update({n: safe_get_full_grad(p).detach().clone() for n, p in actor.module.named_parameters()})
        step()

    actor.step = step_keeping_the_gradient
    trained = ppo.update(rl_models, made, stage, ctx, stage.kl_coef, 0)
    after = {n: p.detach().clone() for n, p in actor.module.named_parameters()}

    last = prompts[schedule.prompt_rows(0, 0, env.world_size - 1)[-1]]  # the rollout's last prompt
    reward_failure = failing_reward(stage, ctx, rl_models, last, mine)

    sequences = {}
    for k in range(len(made)):
        prompt = mine[k // SAMPLES]
        keep = made.mask[k] > 0
        sequences[(prompt.index, k % SAMPLES)] = {
            "tokens": made.sequences[k], "advantages": made.advantages[k][keep].tolist(),
            "grpo_batch": batch_scaled[k][keep].tolist(), "old_logprobs": made.old_logprobs[k][keep].tolist()}
    everyone = [None] * env.world_size
    torch.distributed.all_gather_object(everyone, {"sequences": sequences, "held": len(made),
                                                   "reward_failure": reward_failure})
    if env.rank == 0:
        torch.save({
            "sequences": {key: value for part in everyone for key, value in part["sequences"].items()},
            "held": [part["held"] for part in everyone],
            "reward_failure": [part["reward_failure"] for part in everyone],
            "last_prompt": (last.index, last.text),
            "trained": trained,
            "update": {n: after[n] - before[n] for n in before},
            "gradient": gradient,
            "gradient_accumulation": actor.gradient_accumulation_steps(),
        }, out)
    distributed.shutdown()
    os._exit(0)  # skip DeepSpeed's interpreter teardown (see stages/runner.py)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
