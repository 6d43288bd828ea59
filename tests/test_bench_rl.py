"""The RL group of the GPU benchmark (benchmarks/gpu/rl.py): the actor whose completions end like
RL's, and the table its results make. The group's run itself is checked by `make bench-gpu-dry`."""

import pytest
import torch

from benchmarks.gpu import report, rl, workload


@pytest.mark.skipif(not hasattr(__import__("transformers").LlamaConfig(), "mlp_bias"),
                    reason="the installed transformers' Llama has no mlp_bias "
                           "(4.41+; the benchmark runs on the current stack)")
def test_the_raised_eos_ends_completions_after_about_one_over_its_probability_tokens(tmp_path):
    source = tmp_path / "model"
    workload.build_model_and_tokenizer(source, workload.shape_config("tiny", 128), "fp32", "cpu")
    set_ = rl.eos_model(source, tmp_path / "eos", eos_probability=1 / 8, device="cpu")
    assert set_["eos_scale"] > 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "eos")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "eos").eval()
    prompts = [r["prompt"] for r in rl.prompt_rows(32, model.config.vocab_size, 8, seed=1)]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, top_k=0, max_new_tokens=64, pad_token_id=tokenizer.pad_token_id)
    new = out[:, batch.input_ids.shape[1]:]
    ended = (new == tokenizer.eos_token_id).any(dim=1)
    lengths = [(row == tokenizer.eos_token_id).nonzero()[0].item() + 1 for row in new[ended]]
    assert ended.float().mean() > 0.9  # geometric with p = 1/8: 99.98% end within 64 tokens
    assert 5 < sum(lengths) / len(lengths) < 12  # mean 8
    # Without the raised EOS a random model of 2,048 words almost never ends.
    plain = AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        out = plain.generate(**batch, do_sample=True, top_k=0, max_new_tokens=64, pad_token_id=tokenizer.pad_token_id)
    assert (out[:, batch.input_ids.shape[1]:] == tokenizer.eos_token_id).any(dim=1).float().mean() < 0.2


def test_the_rl_table_shows_each_phase_and_says_what_was_not_measured():
    case = {"case": "project-grpo", "kind": "rl", "settings": rl.settings_of({"device": "cuda"}),
            "rollout_s": 12.5, "generate_s": 9.0, "gather_s": 0.25, "score_s": 1.5, "train_s": 1.9, "other_s": 0.1,
            "generate_tokens_per_s": 3200.0, "generate_bandwidth_fraction": 0.021, "gpu_busy_generate": 0.41,
            "gpu_busy_score": 0.9, "gpu_busy_train": None, "response_length": 290.0}
    lines = report._rl({"project-grpo": case})
    row = next(line for line in lines if line.startswith("| project-grpo"))
    assert row == ("| project-grpo | 128 x 1024 | 12.50 | 9.00 | 0.250 | 1.50 | 1.90 | 0.100 | 3,200 | 2.1% | "
                   "41.0% / 90.0% / — | 290 |")
    assert "- Project / TRL, whole GRPO step: **not measured**" in lines
    trl = {**case, "case": "trl-grpo", "rollout_s": 25.0}
    assert any(line.startswith("- Project / TRL, whole GRPO step: 2.00x as fast (12.50 vs 25.00 s")
               for line in report._rl({"project-grpo": case, "trl-grpo": trl}))
    assert report._rl({}) == []


@pytest.mark.parametrize("longest", [5, 40])
def test_prompts_leave_room_for_the_completion(longest):
    rows = rl.prompt_rows(200, 2048, 100, seed=3, longest=longest)
    assert max(len(r["prompt"].split()) for r in rows) == longest
