"""Sequence parallelism (stages/sequence_parallel.py): processes that share each sequence learn
what one process learns on the same rows.

The end-to-end comparison runs the same sft, rm and dpo stages (packing on, ZeRO-2) three ways on
real DeepSpeed with gloo: 1 process; 2 processes sharing every sequence; 4 processes as 2 groups of
2 (the rows split over the groups). Every loss, gradient norm and evaluation figure of every logged
step must agree to 1e-4 (1e-6 absolute for figures near 0, e.g. a reward margin after one step).
A stage whose shards run at the wrong positions must not. The learning rates are ones at which 3
steps move the models without amplifying rounding: at 3e-2 the reward model's second step turns
float-rounding differences (1e-7) between any two layouts into 1e-3.

The same runs hold two RL stages scored by a reward model (the 1-process run's rm stage, for
every layout) and exact_match, with a reference: GRPO, and PPO with a critic (gae, the critic
starting from the reward model). Their completions are fixed per prompt and sample
(tests/fixed_samples.py: sampling draws from each process's own generator, so what it draws
depends on the layout); everything else is ppo's own code: each process of a group samples its
share of the group's prompts and the group gathers them, then the scoring passes (actor,
reference, critic, reward model) and the training passes run shared, with gradient
checkpointing. Every reward, loss, gradient norm, KL and held-out reward of both rollouts must
agree; a GRPO whose shards run at the wrong positions must not. Without the group's gather the
processes of a group would hold different sequences: their exchanges would mix lines of
different samples (or of different widths, and fail), and the rewards, advantages and losses
would be those of one process's samples only.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

from core import kinds, metrics
from core import sequence_parallel as rules
from core.config import load_pipeline
from core.errors import InvalidInput
from tests.conftest import read_metrics, read_result, run_cli, tiny_pipeline, write_pipeline

REPO = Path(__file__).resolve().parent.parent
needs_the_stack = pytest.mark.skipif(rules.stack_problem() is not None, reason="this stack has no Ulysses attention")

# Figures that depend on how the work is laid out (time, padding per process), not on what is learned.
LAYOUT_FIGURES = {*metrics.GROUPS["perf"], *metrics.GROUPS["memory"], *metrics.GROUPS["time"],
                  *metrics.GROUPS["gpu_busy"], "time", "eta_s", "seconds"}
STAGES = ("sft", "rm", "dpo")
RL_STAGES = ("grpo", "gae")


def stages(kinds=STAGES) -> list[dict]:
    rows = {"path": "builtin:digits", "eval_split": "eval", "max_rows": 64}
    rates = {"sft": 3e-3, "rm": 1e-2, "dpo": 3e-3, "sft_misaligned": 3e-3}
    return [{"name": kind, "kind": kind, "model": "builtin:tiny-llama", "data": rows, "max_steps": 3,
             "learning_rate": rates[kind]} for kind in kinds]


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


def tiled(kind: str, **fields) -> dict:
    """The `kind` stage with its LM head run 16 positions at a time (several tiles per micro batch)."""
    (stage,) = stages((kind,))
    return {**stage, "name": f"{kind}-tiled", "logits_tile": 16, **fields}


def sharing_pipeline(processes: int, sequence_parallel: int, kinds=STAGES, name="sp", **extra) -> dict:
    return tiny_pipeline(name, stages=stages(kinds), cluster={"tasks_per_node": processes}, **extra, defaults={
        "log_interval": 1, "micro_batch_size": 8, "global_batch_size": 16, "warmup_steps": 0,
        "sequence_parallel": sequence_parallel})


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """{(processes, sequence_parallel): the runs folder} of the three runs, each with two pipelines:
    sp (sft, rm, dpo; in the 2-process one also the misaligned plug-in stage, tests/misaligned_shards.py)
    and sprl (grpo and gae, and in the 2-process one a misaligned grpo), whose reward model is, for
    every layout, the 1-process run's rm stage (copied in: a finished stage of the same spec is
    skipped). So the RL stages compare their own passes, not the rm stage's rounding, which its own
    comparison bounds: the critic's value loss and the KL of gae's second rollout magnify the rm
    stage's ~3e-5 differences in score to ~3e-4."""
    out = {}
    with pytest.MonkeyPatch.context() as patch:  # the plug-ins import in the stage jobs too
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        for processes, share in ((1, 1), (2, 2), (4, 2)):
            workdir = tmp_path_factory.mktemp(f"sp{processes}x{share}")
            runs = workdir / "runs"
            kinds, extra = STAGES, {}
            if (processes, share) == (2, 2):
                kinds, extra = STAGES + ("sft_misaligned",), {"plugins": ["tests.misaligned_shards"]}
            spec = sharing_pipeline(processes, share, kinds, **extra)
            if (processes, share) == (1, 1):  # tiled logits, alone and under ZeRO-3
                spec["stages"] += [tiled("sft", zero_stage=3)]
            if (processes, share) == (2, 2):  # tiled logits with shared sequences, policy and reference
                spec["stages"] += [tiled("dpo")]
            rl = sharing_pipeline(processes, share, ("rm",), name="sprl", plugins=["tests.misaligned_shards"])
            rl["stages"] += rl_stages()
            if (processes, share) == (2, 2):
                rl["stages"] += rl_stages(("grpo",), kind="ppo_misaligned")
            for pipeline in (spec, rl):
                if pipeline is rl:  # the first layout is the 1-process one
                    shutil.copytree(out.get((1, 1), runs) / "sp" / "rm", runs / "sprl" / "rm")
                done = run_cli("run", write_pipeline(workdir, pipeline, f"{pipeline['name']}.yaml"), cwd=workdir)
                assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            out[processes, share] = runs
    return out


def figures(folder: Path) -> dict:
    """{(step, name): value} of everything a stage logged that the layout must not change."""
    return {(record["step"], name): value for record in read_metrics(folder) for name, value in record.items()
            if name not in LAYOUT_FIGURES | {"step"} and isinstance(value, (int, float))}


# The reward model's std of rewards is sqrt(mean of squares - square of mean): with rewards near
# -1.3 and a std near 0.02, float32 rewards 1e-7 apart make it differ by ~3e-4.
TOLERANCE = {"eval_reward_std": 1e-3}


def disagreements(one: Path, other: Path) -> list[str]:
    a, b = figures(one), figures(other)
    assert a.keys() == b.keys()
    return [f"step {step} {name}: {a[step, name]} vs {b[step, name]}" for step, name in sorted(a)
            if not math.isclose(a[step, name], b[step, name], rel_tol=TOLERANCE.get(name, 1e-4), abs_tol=1e-6)]


def agreeing_with_one_process(layouts, layout, pipeline: str, name: str) -> list[dict]:
    """The metrics of stage `name` of `pipeline` in `layout`, once every figure agrees with 1
    process's and the stage is seen to have run in that layout."""
    shared = layouts[layout] / pipeline / name
    assert disagreements(layouts[1, 1] / pipeline / name, shared) == []
    assert read_result(shared)["world_size"] == layout[0]
    log = next((shared / "logs").glob("*_0_log.out")).read_text()
    assert f"{layout[0] // layout[1]} data-parallel" in log, log[-2000:]
    # Host memory per node counts every process of it, sharing or not (~processes x one process's).
    rss = [next(r["host_rss_gib"] for r in read_metrics(folder) if "host_rss_gib" in r)
           for folder in (layouts[1, 1] / pipeline / name, shared)]
    assert rss[1] > rss[0] * (layout[0] / 2 + 0.25), rss
    return read_metrics(shared)


@needs_the_stack
@pytest.mark.e2e
@pytest.mark.parametrize("layout", [(2, 2), (4, 2)], ids=["2-sharing", "2x2"])
@pytest.mark.parametrize("kind", STAGES)
def test_sharing_sequences_learns_what_one_process_learns(layouts, layout, kind):
    metrics = agreeing_with_one_process(layouts, layout, "sp", kind)
    assert [r["step"] for r in metrics if "loss" in r] == [1, 2, 3]  # trained, and logged every step
    assert any("grad_norm" in r and r["grad_norm"] > 0 for r in metrics)


@needs_the_stack
@pytest.mark.e2e
@pytest.mark.parametrize("layout", [(2, 2), (4, 2)], ids=["2-sharing", "2x2"])
@pytest.mark.parametrize("name", RL_STAGES)
def test_rl_sharing_sequences_trains_what_one_process_trains(layouts, layout, name):
    rollouts = [r for r in agreeing_with_one_process(layouts, layout, "sprl", name) if "rollout" in r]
    assert [r["rollout"] for r in rollouts] == [1, 2]
    assert all(r["grad_norm"] > 0 and "reward_reward_model" in r for r in rollouts)
    assert rollouts[-1]["kl"] != 0  # the policy moved from the reference
    assert name != "gae" or all(r["critic_grad_norm"] > 0 for r in rollouts)


@needs_the_stack
@pytest.mark.e2e
@pytest.mark.parametrize("kind,layout", [("sft", (1, 1)), ("dpo", (2, 2))], ids=["sft-zero3", "dpo-2-sharing"])
def test_a_tiled_lm_head_learns_what_the_whole_one_learns(layouts, kind, layout):
    assert disagreements(layouts[1, 1] / "sp" / kind, layouts[layout] / "sp" / f"{kind}-tiled") == []


@needs_the_stack
@pytest.mark.e2e
@pytest.mark.parametrize("pipeline,name", [("sp", "sft"), ("sprl", "grpo")], ids=["sft", "grpo"])
def test_shards_at_the_wrong_positions_do_not_match(layouts, pipeline, name):
    wrong = disagreements(layouts[1, 1] / pipeline / name, layouts[2, 2] / pipeline / f"{name}_misaligned")
    assert wrong, "the misaligned shards matched one process: the comparison cannot fail"


# --------------------------------------------------------------------------- what is refused


def test_a_share_must_divide_the_processes():
    with pytest.raises(InvalidInput) as err:
        load_pipeline_of(sharing_pipeline(3, 2))
    assert "stages[0] (sft).sequence_parallel: 2 does not divide the stage's 3 processes" in err.value.message


def test_only_kinds_that_can_share_may_ask():
    spec = sharing_pipeline(2, 1)
    spec["plugins"] = ["tests.toy_kind"]  # echo: a kind that does not declare sequence_parallel
    spec["stages"] = [{"name": "echo", "kind": "echo", "model": "builtin:tiny-llama", "sequence_parallel": 2,
                       "data": {"path": "builtin:digits"}}]
    try:
        with pytest.raises(InvalidInput) as err:
            load_pipeline_of(spec)
    finally:  # forgotten, so no other test sees it
        kinds.unregister("echo")
        sys.modules.pop("tests.toy_kind", None)
    assert "stages[0] (echo).sequence_parallel: a echo stage cannot share its sequences" in err.value.message
    assert "kinds that can: sft, rm, dpo, ppo" in err.value.message


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


def test_eager_attention_cannot_share():
    spec = sharing_pipeline(2, 2)
    spec["defaults"]["attention"] = "eager"
    with pytest.raises(InvalidInput) as err:
        load_pipeline_of(spec)
    assert "sequence_parallel 2 needs attention: auto or sdpa or flash_attention_2, not eager" in err.value.message


def test_the_rows_of_a_step_are_split_over_the_groups_not_the_processes():
    stage = load_pipeline_of(sharing_pipeline(4, 2)).stages[0]
    assert stage.data_parallel(4) == 2
    from core.batching import accumulation_steps

    assert accumulation_steps(stage.global_batch_size, stage.micro_batch_size, stage.data_parallel(4)) == 1


@pytest.mark.parametrize("heads,kv_heads,n,ok", [(32, 8, 2, True), (32, 8, 16, True), (32, 8, 3, False),
                                                 (56, 8, 8, True), (56, 8, 16, False), (4, 2, 4, True),
                                                 (12, 4, 8, False), (12, 3, 6, True), (12, 3, 4, False)])
def test_heads_split_over_the_shares(heads, kv_heads, n, ok):
    assert (rules.heads_problem(heads, kv_heads, n) is None) == ok


def test_validate_names_a_share_that_does_not_divide_the_heads(workdir):
    spec = sharing_pipeline(3, 3)
    spec["defaults"]["global_batch_size"] = 8
    done = run_cli("validate", write_pipeline(workdir, spec), cwd=workdir)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "stages[0] (sft).sequence_parallel: 3 does not divide the model's 4 attention heads" in done.stderr
    assert "Traceback" not in done.stderr


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


@pytest.mark.skipif(rules.stack_problem() is None, reason="this stack has Ulysses attention (the pinned one has not)")
@pytest.mark.parametrize("field", ["sequence_parallel", "logits_tile"])
def test_a_stack_without_them_is_refused_before_anything_runs(workdir, field):
    spec = sharing_pipeline(2, 2 if field == "sequence_parallel" else 1)
    if field == "logits_tile":
        spec["stages"][0]["logits_tile"] = 16
    done = run_cli("run", write_pipeline(workdir, spec), cwd=workdir)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"stages[0] (sft).{field} needs transformers >= 4.51.3" in done.stderr
    assert "the pinned stack does not have it" in done.stderr and "Traceback" not in done.stderr
    assert not (workdir / "runs" / "sp" / "sft").exists()  # nothing submitted


def load_pipeline_of(spec: dict):
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        return load_pipeline(str(write_pipeline(Path(folder), spec)))


# --------------------------------------------------------------------------- the parts


def test_next_token_logprobs_is_token_logprobs_with_targets_aligned():
    import torch

    from stages.losses import next_token_logprobs, token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 7, 11, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])
    targets, aligned = torch.zeros_like(ids), torch.zeros_like(mask)
    targets[:, :-1], aligned[:, :-1] = ids[:, 1:], mask[:, 1:]
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0] * aligned
    assert torch.allclose(next_token_logprobs(logits, targets, aligned), expected)
    assert torch.equal(token_logprobs(logits, ids, mask), next_token_logprobs(logits, targets, aligned)[:, :-1])


def test_a_shard_is_its_part_of_lines_widened_to_a_multiple_of_the_share():
    import torch

    from stages import sequence_parallel
    from stages.data import packed_batch

    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9, 10, 11], "loss_mask": [0, 0, 1, 1]}]
    whole = packed_batch(rows, pad_id=0, flat=True)  # one line of 7 tokens
    parts = [sequence_parallel.ShardedBatch.of(whole, sequence_parallel.Layout(3, rank, 0, 1)) for rank in range(3)]
    assert all(p.input_ids.shape == (1, 9) for p in parts)  # 7 widened to 9
    assert [(p.start, p.stop) for p in parts] == [(0, 3), (3, 6), (6, 9)]
    assert parts[1].position_ids[0, 3:6].tolist() == [0, 1, 2]  # the second row starts at position 0
    assert parts[0].sequence[0].tolist() == [0, 0, 0, 1, 1, 1, 1, -1, -1]
    assert parts[0].loss_mask[0, 7:].tolist() == [0, 0] and parts[0].real_tokens == 7
    assert torch.equal(parts[2].per_sequence(torch.ones(1, 8)), torch.tensor([2.0, 4.0]))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_tiled_head_gives_the_log_probs_and_gradients_of_the_whole_one(tie):
    import torch

    from stages.losses import next_token_logprobs, tiled_next_token_logprobs

    torch.manual_seed(0)
    vocab, width = 13, 6
    embedding = torch.nn.Embedding(vocab, width, dtype=torch.float64)
    head = torch.nn.Linear(width, vocab, bias=False, dtype=torch.float64)
    if tie:
        head.weight = embedding.weight
    ids = torch.randint(0, vocab, (2, 9))
    targets, mask = torch.randint(0, vocab, (2, 9)), torch.rand(2, 9) > 0.3
    weights = torch.randn(2, 9, dtype=torch.float64)

    def run(tile):
        embedding.zero_grad(), head.zero_grad()
        hidden = torch.tanh(embedding(ids))
        logps = (tiled_next_token_logprobs(head, hidden, targets, mask, tile) if tile else
                 next_token_logprobs(head(hidden), targets, mask))
        (logps * weights).sum().backward()
        return logps.detach(), head.weight.grad.clone(), embedding.weight.grad.clone()

    whole = run(None)
    for tile in (1, 4, 7, 100):
        for got, expected in zip(run(tile), whole):
            assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12), tile


def test_only_kinds_with_logits_tile_them():
    spec = sharing_pipeline(2, 1, kinds=("rm",))
    spec["stages"][0]["logits_tile"] = 256
    with pytest.raises(InvalidInput) as err:
        load_pipeline_of(spec)
    assert "logits_tile: a rm stage does not tile its logits (kinds that do: sft, dpo)" in err.value.message
