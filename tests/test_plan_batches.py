"""The plan reads the data: token lengths sampled from a stage's rows, the micro batches
core/batching.py makes of them, and the step time those take.

Expected numbers are worked by hand from small fixed lengths.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest

from core import flops, shapes
from core.config import DataSpec
from pipeline import lengths, plan
from pipeline.hfcache import HFCache
from pipeline.plan.batches import simulate
from tests.test_plan import stage as planned_stage

TINY = shapes.ModelShape(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=48, max_positions=64)
LLAMA32_1B = shapes.ModelShape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256,
                               max_positions=131072, tied_embeddings=True)
EIGHT = ((100,), (300,), (200,), (400,), (50,), (350,), (150,), (250,))  # one SFT sequence per row


def rows(*counts):
    return lengths.RowLengths(tuple(counts), "a fixed list", "given")


def sft(**fields):
    return plan.Knobs(**{"kind": "sft", "max_len": 512, "micro_batch_size": 2, "global_batch_size": 8, **fields})


def stage(**fields):
    return planned_stage(**{"attention": "sdpa", "micro_batch_size": 4, "global_batch_size": 32, **fields})


def h100(gpus=1):
    return plan.Hardware.from_cluster(SimpleNamespace(gpu="h100-80gb", gpus_per_node=gpus, tasks_per_node=None))


# --------------------------------------------------------------------------- micro batches


def test_padded_micro_batches_waste_what_padding_to_the_longest_costs():
    batches = simulate(sft(packing=False), world=1, sequences_per_row=1, flat=False, lengths=rows(*EIGHT))
    # rows in turn, two per micro batch: [100 300] [200 400] [50 350] [150 250] padded to 300, 400, 350, 250
    assert batches.micro_batches_per_step == 4
    assert batches.processed_tokens_per_step == 2 * (300 + 400 + 350 + 250)
    assert batches.real_tokens_per_step == 1800
    assert batches.padding_share == pytest.approx(800 / 2600)


def test_packing_fills_token_budgets_first_fit_decreasing():
    batches = simulate(sft(), world=1, sequences_per_row=1, flat=False, lengths=rows(*EIGHT))
    # budget 2 x 512 = 1024: [400 350 250] = 1000 and [300 200 150 100 50] = 800, each on one line (too
    # short for two lines of 512)
    (only_process,) = batches.steps[0]
    assert [m.processed_tokens for m in only_process] == [1000, 800]
    assert batches.padding_share == 0


def test_packing_wastes_at_most_3_percent_of_realistic_lengths():
    rng = random.Random(1)
    sample = tuple((min(4000, int(rng.lognormvariate(math.log(400), 0.8))),) for _ in range(1000))
    for flat in (False, True):
        batches = simulate(sft(max_len=2048, micro_batch_size=4, global_batch_size=32), world=2,
                           sequences_per_row=1, flat=flat, lengths=rows(*sample))
        assert batches.padding_share <= 0.03
        assert len(batches.steps) == 8  # eight global batches of 32 drawn from the 1000 rows
    padded = simulate(sft(max_len=2048, micro_batch_size=4, global_batch_size=32, packing=False), world=2,
                      sequences_per_row=1, flat=False, lengths=rows(*sample))
    assert padded.padding_share > 0.3


def test_rows_are_truncated_to_max_len_and_unknown_data_is_max_len_per_row():
    batches = simulate(sft(max_len=128), world=1, sequences_per_row=1, flat=True, lengths=rows((500,), (20,)))
    assert sorted(batches.row_tokens) == [20, 128]
    unknown = simulate(sft(), world=2, sequences_per_row=2, flat=True, lengths=None)
    assert unknown.real_tokens_per_step == 8 * 2 * 512 and unknown.padding_share == 0


# --------------------------------------------------------------------------- FLOPs of a pass


def test_one_sequence_alone_executes_its_model_flops():
    for trained in (False, True):
        assert flops.pass_flops(TINY, "lm", 40, 40 * 40, trained=trained) == flops.sequence_flops(
            TINY, "lm", 40, trained)


def test_a_mask_makes_attention_cover_the_whole_line():
    # a line 10 wide holding sequences of 4 and 6: a mask scores 10 x 10 pairs, flash 4 x 4 + 6 x 6
    masked = flops.pass_flops(TINY, "lm", 10, 10 * 10, trained=False)
    varlen = flops.pass_flops(TINY, "lm", 10, 4 * 4 + 6 * 6, trained=False)
    assert masked - varlen == 4 * 2 * 64 * (100 - 52)  # 4 x layers x q_width per scored pair


# --------------------------------------------------------------------------- sampling lengths


def write_jsonl(path, rows_):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


SFT_ROWS = [{"prompt": "sort 321 =", "response": " 123"}, {"prompt": "sort 9 8 7 6 =", "response": " 6789 ok"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from core import tiny

    return tiny.materialize("tiny-llama", tmp_path_factory.mktemp("builtin"))


def test_a_local_tokenizer_counts_the_tokens(tmp_path, tiny_model):
    data = DataSpec(path=str(write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)))
    sampled = lengths.sample(data, "sft", str(tiny_model))
    # the character tokenizer: <s> + one token per character of prompt and response + </s>
    assert sorted(sampled.rows) == sorted((1 + len(r["prompt"]) + len(r["response"]) + 1,) for r in SFT_ROWS)
    assert "tokenizer.json" in sampled.counter and "2 rows sampled from" in sampled.source


def test_without_a_local_tokenizer_tokens_are_characters_over_4(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    data = DataSpec(path=str(write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)))
    sampled = lengths.sample(data, "sft", "my-org/not-downloaded")
    # ceil(10 / 4) + a bos and ceil(4 / 4) + an eos; ceil(14 / 4) + 1 and ceil(8 / 4) + 1
    assert sorted(sampled.rows) == [(3 + 1 + 1 + 1,), (4 + 1 + 2 + 1,)]
    assert "characters / 4" in sampled.counter


def test_a_pair_counts_the_prompt_with_each_response(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    pair = {"prompt": "abcdefgh", "chosen": "abcd", "rejected": "abcdefghijkl"}
    data = DataSpec(path=str(write_jsonl(tmp_path / "pairs.jsonl", [pair])))
    assert lengths.sample(data, "dpo", "my-org/x").rows == ((2 + 1 + 1 + 1, 2 + 1 + 3 + 1),)


def test_builtin_digits_are_generated_and_counted_exactly():
    sampled = lengths.sample(DataSpec(path="builtin:digits", response_key="demo"), "sft", "builtin:tiny-llama")
    assert len(sampled.rows) == lengths.SAMPLE_ROWS
    from core import tiny

    first = dict(tiny.digits_splits())["train"][0]
    assert sampled.rows[0] == (1 + len(first["prompt"]) + len(first["demo"]) + 1,)


def test_data_that_is_not_here_means_max_len_and_says_why(tmp_path):
    missing = lengths.sample(DataSpec(path=str(tmp_path / "nowhere.jsonl")), "sft", "builtin:tiny-llama")
    cache = HFCache(home=tmp_path, hub=tmp_path / "hub", datasets=tmp_path)
    hub = lengths.sample(DataSpec(path="my-org/prefs"), "dpo", "builtin:tiny-llama", cache)
    assert not missing.sampled and "not on this machine" in missing.describe()
    assert not hub.sampled and "not in the cache" in hub.describe() and "max_len assumed" in hub.describe()


def test_a_saved_dataset_folder_is_read_through_its_arrow_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    (tmp_path / "train").mkdir()
    table = pa.table({"prompt": ["ab", "abcdef"], "response": ["c", "cd"]})
    with pa.ipc.new_stream(str(tmp_path / "train" / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)  # how `datasets` save_to_disk stores a split
    sampled = lengths.sample(DataSpec(path=str(tmp_path)), "sft", "builtin:tiny-llama")
    assert sorted(sampled.rows) == [(1 + 2 + 1 + 1,), (1 + 6 + 2 + 1,)]
    assert "dataset folder" in sampled.source


def test_a_large_jsonl_file_is_sampled_by_seeking(tmp_path, monkeypatch):
    monkeypatch.setattr(lengths, "FULL_READ_BYTES", 1000)
    many = [{"prompt": "p" * (i % 50 + 1), "response": "r"} for i in range(5000)]
    data = DataSpec(path=str(write_jsonl(tmp_path / "big.jsonl", many)))
    sampled = lengths.sample(data, "sft", "builtin:tiny-llama", limit=200)
    assert 150 < len(sampled.rows) <= 200  # a few offsets land in the same line
    assert all(1 + 1 + 1 + 1 <= n <= 1 + 50 + 1 + 1 for (n,) in sampled.rows)  # <s> p..p r </s>


# --------------------------------------------------------------------------- the step time


def test_real_lengths_shorten_the_predicted_step_and_count_real_tokens():
    rng = random.Random(1)
    sample = rows(*((min(4000, int(rng.lognormvariate(math.log(400), 0.8))),) for _ in range(1000)))
    at_max_len = plan.plan_stage(stage(), LLAMA32_1B, h100()).time
    packed = plan.plan_stage(stage(), LLAMA32_1B, h100(), lengths=sample).time
    padded = plan.plan_stage(stage(packing=False), LLAMA32_1B, h100(), lengths=sample).time
    assert at_max_len.tokens_per_step == 32 * 2048 and at_max_len.token_efficiency == 1
    assert packed.step_s < padded.step_s < at_max_len.step_s
    assert packed.token_efficiency >= 0.97 and padded.token_efficiency < 0.7
    assert packed.tokens_per_s == pytest.approx(packed.tokens_per_step / packed.step_s)
    # MFU as metrics.jsonl reports it: the sequences' model FLOPs over step time x peak
    model = packed.model_flops_per_token * packed.tokens_per_step
    assert packed.mfu == pytest.approx(model / (packed.step_s * 989e12))
    # packed sdpa lines attend over their whole width (~2048 wide, holding ~400-token sequences): a fifth
    # more executed than model FLOPs here; flash attention on one flat line executes the model FLOPs
    assert 1.1 < packed.flops_per_token / packed.model_flops_per_token < 1.3
    flash = plan.plan_stage(stage(attention="flash_attention_2"), LLAMA32_1B, h100(), lengths=sample).time
    assert flash.flops_per_token == pytest.approx(flash.model_flops_per_token)
    assert flash.step_s < packed.step_s


def test_the_optimizer_step_is_memory_bound():
    # bf16 on one GPU: the bytes per parameter the records measured the step at (pipeline/plan/rates.py),
    # at the H100's copy bandwidth (a 1 GiB device copy on record, core/hardware.py)
    for zero_stage, per_param in ((0, 224), (2, 344)):
        t = plan.plan_stage(stage(zero_stage=zero_stage), LLAMA32_1B, h100()).time
        assert t.optimizer_s == pytest.approx(LLAMA32_1B.n_params * per_param / 2589e9)


def test_the_plan_says_where_lengths_came_from_and_what_the_batches_hold(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    sample = lengths.sample(DataSpec(path=str(write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS * 20))), "sft", "x/y")
    p = plan.plan_stage(stage(), LLAMA32_1B, h100(), lengths=sample)
    text = plan.format_plan([p])
    assert "40 rows sampled from" in text and "characters / 4" in text
    assert "packed, up to 8,192 tokens per micro batch" in text and "% padding" in text and "tokens/s" in text
    assert "max_len assumed per row" in plan.format_plan([plan.plan_stage(stage(), LLAMA32_1B, h100())])
