"""Sequence parallelism (stages/sequence_parallel.py): processes that share each sequence learn
what one process learns on the same rows.

The end-to-end comparison runs the same sft, rm and dpo stages (packing on, ZeRO-2) three ways on
real DeepSpeed with gloo: 1 process; 2 processes sharing every sequence; 4 processes as 2 groups of
2 (the rows split over the groups). Every loss, gradient norm and evaluation figure of every logged
step must agree to 1e-4 (1e-6 absolute for figures near 0, e.g. a reward margin after one step).
A stage whose shards run at the wrong positions must not. The learning rates are ones at which 3
steps move the models without amplifying rounding: at 3e-2 the reward model's second step turns
float-rounding differences (1e-7) between any two layouts into 1e-3. The same comparison for
ppo's passes is tests/test_sequence_parallel_rl.py's.
"""

from __future__ import annotations

import sys

import pytest

from core import kinds
from core import sequence_parallel as rules
from core.errors import InvalidInput
from tests.conftest import plugins_importable, run_cli, write_pipeline
from tests.sharing_support import (
    LAYOUTS,
    STAGES,
    agreeing_with_one_process,
    disagreements,
    load_pipeline_of,
    needs_the_stack,
    ran,
    sharing_pipeline,
    stages,
)


def tiled(kind: str, **fields) -> dict:
    """The `kind` stage with its LM head run 16 positions at a time (several tiles per micro batch)."""
    (stage,) = stages((kind,))
    return {**stage, "name": f"{kind}-tiled", "logits_tile": 16, **fields}


def mlp_tiled(kind: str, **fields) -> dict:
    """The `kind` stage with every MLP run in 3 tiles of positions. A hang (processes calling the
    MLP a different number of times under ZeRO-3) fails its collectives after 2 minutes (rank 0
    writing the built-in model, which the others wait for, takes ~20 s on a busy 2-core machine)."""
    (stage,) = stages((kind,))
    return {**stage, "name": f"{kind}-mlp", "mlp_tiles": 3, "collective_timeout_s": 120, **fields}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """{(processes, sequence_parallel): the run folder} of the three runs; the 2-process one also
    runs the misaligned plug-in stage (tests/misaligned_shards.py). A fourth, of 2 processes that
    share nothing, runs only a tiled-MLP stage."""
    out = {}
    with plugins_importable():
        for processes, share in (*LAYOUTS, (2, 1)):
            workdir = tmp_path_factory.mktemp(f"sp{processes}x{share}")
            names, extra = STAGES, {}
            if (processes, share) == (2, 2):
                names, extra = STAGES + ("sft_misaligned",), {"plugins": ["tests.misaligned_shards"]}
            spec = sharing_pipeline(processes, share, names, **extra)
            if (processes, share) == (1, 1):  # tiled logits, alone and under ZeRO-3; tiled MLPs, checkpointed
                spec["stages"] += [tiled("sft", zero_stage=3),
                                   mlp_tiled("rm", zero_stage=3, gradient_checkpointing=True)]
            if (processes, share) == (2, 2):  # tiled logits and MLPs with shared sequences, policy and reference
                spec["stages"] += [tiled("dpo", mlp_tiles=3)]
            if (processes, share) == (2, 1):  # tiled MLPs under ZeRO-3, the 2 processes' lines of different widths
                spec["stages"] = [mlp_tiled("sft", zero_stage=3)]
            out[processes, share] = ran(workdir, spec)
    return out


@needs_the_stack
@pytest.mark.e2e
@pytest.mark.parametrize("layout", [(2, 2), (4, 2)], ids=["2-sharing", "2x2"])
@pytest.mark.parametrize("kind", STAGES)
def test_sharing_sequences_learns_what_one_process_learns(layouts, layout, kind):
    metrics = agreeing_with_one_process(layouts[1, 1] / kind, layouts[layout] / kind, layout)
    assert [r["step"] for r in metrics if "loss" in r] == [1, 2, 3]  # trained, and logged every step
    assert any("grad_norm" in r and r["grad_norm"] > 0 for r in metrics)


@needs_the_stack
@pytest.mark.e2e
@pytest.mark.parametrize("kind,layout", [("sft", (1, 1)), ("dpo", (2, 2))], ids=["sft-zero3", "dpo-2-sharing"])
def test_a_tiled_lm_head_learns_what_the_whole_one_learns(layouts, kind, layout):
    assert disagreements(layouts[1, 1] / kind, layouts[layout] / f"{kind}-tiled") == []


@needs_the_stack
@pytest.mark.e2e
@pytest.mark.parametrize("kind,layout,name", [("rm", (1, 1), "rm-mlp"), ("sft", (2, 1), "sft-mlp"),
                                               ("dpo", (2, 2), "dpo-tiled")],
                         ids=["rm-zero3-checkpointed", "sft-zero3-2-processes", "dpo-2-sharing"])
def test_tiled_mlps_learn_what_whole_ones_learn(layouts, kind, layout, name):
    assert disagreements(layouts[1, 1] / kind, layouts[layout] / name) == []
    log = next((layouts[layout] / name / "logs").glob("*_0_log.out")).read_text()
    assert "mlp_tiles 3: every decoder layer's MLP runs" in log, log[-2000:]


@needs_the_stack
@pytest.mark.e2e
def test_shards_at_the_wrong_positions_do_not_match(layouts):
    wrong = disagreements(layouts[1, 1] / "sft", layouts[2, 2] / "sft_misaligned")
    assert wrong, "the misaligned shards matched one process: the comparison cannot fail"


# --------------------------------------------------------------------------- what is refused


def test_a_share_must_divide_the_processes():
    with pytest.raises(InvalidInput) as err:
        load_pipeline_of(sharing_pipeline(3, 2))
    assert "stages[0] (sft).sequence_parallel: 2 does not divide the stage's 3 processes" in err.value.message


def ppo_stage(**fields) -> dict:
    return {"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
            "reward": {"rules": [{"rule": "exact_match"}]}, **fields}


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
    assert "stages[0] (sft).sequence_parallel: 3 does not divide the model's 2 attention heads" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(rules.stack_problem() is None, reason="this stack has Ulysses attention (the pinned one has not)")
@pytest.mark.parametrize("field", ["sequence_parallel", "logits_tile", "mlp_tiles"])
def test_a_stack_without_them_is_refused_before_anything_runs(workdir, field):
    spec = sharing_pipeline(2, 2 if field == "sequence_parallel" else 1)
    if field != "sequence_parallel":
        spec["stages"][0][field] = 16
    done = run_cli("run", write_pipeline(workdir, spec), cwd=workdir)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"stages[0] (sft).{field} needs transformers >= 4.51.3" in done.stderr
    assert "the pinned stack does not have it" in done.stderr and "Traceback" not in done.stderr
    assert not (workdir / "runs" / "sp" / "sft").exists()  # nothing submitted


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


def test_only_kinds_with_mlps_to_tile_tile_them():
    spec = sharing_pipeline(2, 1)
    spec["stages"] = [ppo_stage(mlp_tiles=4)]
    with pytest.raises(InvalidInput) as err:
        load_pipeline_of(spec)
    assert "mlp_tiles: a ppo stage does not tile its MLPs (kinds that do: sft, rm, dpo)" in err.value.message
