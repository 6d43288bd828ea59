"""stages/compat.py and the modules beside it (pretrained, rotary_fp32, packed_attention, self_check):
models load, train and export the same way on every supported stack (transformers 4.37.2,
4.38.2 + DeepSpeed 0.13.2, 5.x + DeepSpeed 0.19).

The slow tests load a tiny Llama through the project's loader under real ZeRO-3 in a process
of their own (tests/compat_probe.py). Run with POST_TRAIN_COMPAT_OFF=rotary_fp32 (or
causal_mask_cap) where that patch applies and the matching test fails; the *_is_needed tests
do exactly that on purpose, and are skipped on stacks that do not need the patch.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from core import tiny
from stages import compat, deepspeed_ops, packed_attention, pretrained, rotary_fp32
from tests.conftest import REPO

PROBE = REPO / "tests" / "compat_probe.py"


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny.materialize("tiny-llama", tmp_path_factory.mktemp("compat"))


def with_positions(tiny_llama, positions: int):
    """A copy of the tiny Llama whose config says max_position_embeddings=positions
    (written by editing config.json: building a 200K model to save it would allocate the mask)."""
    folder = tiny_llama.parent / f"tiny-llama-{positions}"
    if not folder.exists():
        shutil.copytree(tiny_llama, folder)
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = positions
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def probe(scenario: str, folder, off: str | None = None, timeout=600):
    """(result dict or None, return code, output) of tests/compat_probe.py in its own process."""
    env = dict(os.environ)
    if off is not None:
        env[compat.OFF_SWITCH] = off
    done = subprocess.run([sys.executable, str(PROBE), scenario, str(folder)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    return (json.loads(lines[-1][len("PROBE "):]) if lines else None), done.returncode, output


def causal_mask_cap_applies() -> bool:
    from transformers import LlamaConfig

    return pretrained.registers_square_causal_mask(LlamaConfig())


# --------------------------------------------------------------------------- spellings


def test_from_pretrained_kwargs_load_the_requested_dtype_and_attention(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, **compat.from_pretrained_kwargs(torch.bfloat16, "eager"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"


def test_an_attention_name_the_installed_transformers_lacks_is_refused_with_the_valid_names():
    assert {"eager", "sdpa", "flash_attention_2"} <= set(compat.attention_implementations())
    with pytest.raises(ValueError, match="eager, .*sdpa"):
        compat.from_pretrained_kwargs(torch.float32, "flash_attention_9")


def test_chat_template_ids_are_a_plain_list_of_token_ids():
    tokenizer = tiny.build_tokenizer()
    messages = [{"role": "user", "content": "sort 21"}, {"role": "assistant", "content": "12"}]
    ids = compat.chat_template_ids(tokenizer, messages, add_generation_prompt=False)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_hf_deepspeed_config_turns_zero3_loading_on_while_it_lives():
    from transformers.integrations import is_deepspeed_zero3_enabled

    live = compat.hf_deepspeed_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    assert is_deepspeed_zero3_enabled()
    del live
    assert not is_deepspeed_zero3_enabled()


def test_the_off_switch_rejects_unknown_patch_names(monkeypatch):
    monkeypatch.setenv(compat.OFF_SWITCH, "rotary")
    with pytest.raises(ValueError, match="rotary_fp32, causal_mask_cap"):
        compat.disabled_patches()


def test_rotary_cos_sin_is_called_with_the_installed_signature():
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=128)
    rotary = next(m for m in LlamaModel(config).modules() if type(m).__name__.endswith("RotaryEmbedding"))
    signature = rotary_fp32.rotary_signature(type(rotary))
    assert "position_ids" in signature or "seq_len" in signature
    cos, sin = rotary_fp32.rotary_cos_sin(rotary, 128)
    assert cos.shape == sin.shape == (128, 16) and cos.dtype == torch.float32
    torch.testing.assert_close(cos[0], torch.ones(16))
    torch.testing.assert_close(cos.square() + sin.square(), torch.ones(128, 16))


# --------------------------------------------------------------------------- DeepSpeed ops


@pytest.mark.parametrize("value,rewritten", [
    ("9.0a", "9.0"),
    ("9.0a;8.0", "9.0;8.0"),
    ("8.0 8.6 9.0+PTX", "8.0;8.6;9.0+PTX"),
    ("7.0;7.5;8.0;8.6+PTX", "7.0;7.5;8.0;8.6+PTX"),
    ("9.0a+PTX", "9.0+PTX"),
    ("10.0f;12.0a+PTX", "10.0;12.0+PTX"),
    ("9.0;9.0a", "9.0"),
    ("Hopper;8.0", "8.0"),
    ("native", None),
    ("", ""),
    (None, None),
])
def test_arch_lists_are_rewritten_into_what_deepspeeds_op_builder_reads(value, rewritten):
    assert compat.deepspeed_arch_list(value) == rewritten


def compiled_archs(arch_list: str, jit: bool) -> list[str]:
    """What the installed DeepSpeed's CUDA op builder makes of TORCH_CUDA_ARCH_LIST (no GPU
    needed: it only reads the list): the sm_XY it compiles for."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    saved = os.environ.get(compat.ARCH_LIST)
    os.environ[compat.ARCH_LIST] = arch_list
    try:
        builder = FusedAdamBuilder()
        builder.jit_mode = jit
        args = builder.compute_capability_args()
        if args:
            archs = re.findall(r"code=sm_(\d+)", " ".join(args))
        else:  # a JIT build hands torch the list back in the variable instead of flags
            archs = [entry.split("+")[0].replace(".", "") for entry in os.environ[compat.ARCH_LIST].split(";")]
    finally:
        if saved is None:
            os.environ.pop(compat.ARCH_LIST, None)
        else:
            os.environ[compat.ARCH_LIST] = saved
    return sorted({f"sm_{arch}" for arch in archs})


@pytest.mark.parametrize("value", ["9.0a", "9.0a;8.0", "8.0 8.6 9.0+PTX", "7.0;7.5;8.0;8.6+PTX"])
def test_the_installed_deepspeed_builds_for_every_arch_of_a_rewritten_list(value):
    wanted = sorted({f"sm_{m.group(1)}{m.group(2)}" for m in re.finditer(r"(\d+)\.(\d+)", value)})
    assert compiled_archs(compat.deepspeed_arch_list(value), jit=False) == wanted


def test_deepspeeds_jit_builder_fails_on_9_0a_and_reads_its_rewrite():
    try:
        compiled_archs("8.0", jit=True)
    except (IndexError, RuntimeError):
        pytest.skip("this DeepSpeed's JIT builder ignores TORCH_CUDA_ARCH_LIST and asks the GPUs")
    with pytest.raises(ValueError, match="invalid literal for int"):
        compiled_archs("9.0a", jit=True)
    assert compiled_archs(compat.deepspeed_arch_list("9.0a"), jit=True) == ["sm_90"]


def test_the_gpu_optimizer_needs_no_deepspeed_op_and_offload_needs_cpu_adam():
    from core.schemas.sft import SFTStage
    from stages import engine

    def op(**knobs):
        stage = SFTStage.model_validate({"name": "s", "kind": "sft", "model": "builtin:tiny-llama",
                                         "data": {"path": "builtin:digits"}, **knobs})
        return compat.optimizer_op(engine.deepspeed_config(stage, 8, 4096, on_gpu=True))

    assert op() is None
    assert op(optimizer_offload=True) == "cpu_adam"


def test_the_stage_process_rewrites_its_arch_list_once_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv(compat.ARCH_LIST, "8.0 9.0a")
    monkeypatch.setattr(compat, "_logged", set())
    with caplog.at_level("INFO", logger="stages"):
        compat.normalize_arch_list_env()
        compat.normalize_arch_list_env()
    assert os.environ[compat.ARCH_LIST] == "8.0;9.0"
    assert [r.getMessage() for r in caplog.records] == [
        "compat: TORCH_CUDA_ARCH_LIST='8.0 9.0a' rewritten to '8.0;9.0': "
        "DeepSpeed's op builder reads only MAJOR.MINOR[+PTX] entries"]


# --------------------------------------------------------------------------- under ZeRO-3


@pytest.mark.slow
def test_self_check_reports_versions_and_passes():
    env = {**os.environ, compat.ARCH_LIST: "8.0 9.0a"}
    done = subprocess.run([sys.executable, "-m", "stages.self_check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"transformers {compat.versions()['transformers']}" in done.stdout
    assert "rotary_fp32:" in done.stdout and "causal_mask_cap:" in done.stdout
    assert "max |error| 0 (OK)" in done.stdout
    assert "DeepSpeed ops prebuilt" in done.stdout
    assert f"JIT-built extensions in {deepspeed_ops.extensions_dir()}: " in done.stdout
    assert ("optimizer of a GPU stage: without optimizer_offload: torch.optim.AdamW(fused=True), no build; "
            "with optimizer_offload: DeepSpeed cpu_adam (") in done.stdout
    assert "TORCH_CUDA_ARCH_LIST: '8.0 9.0a': stage jobs use '8.0;9.0'" in done.stdout


@pytest.mark.slow
def test_rotary_cos_sin_of_a_zero3_bf16_model_equal_an_fp32_build(tiny_llama):
    # 4096 positions: bf16 holds integers exactly only up to 256.
    result, code, output = probe("rotary", with_positions(tiny_llama, 4096))
    assert code == 0, output[-3000:]
    assert result["rotary_modules"] >= 1
    assert result["max_error"] < 1e-5, result


@pytest.mark.slow
def test_rotary_patch_is_needed_where_it_applies(tiny_llama):
    needed, reason = compat.rotary_patch_needed()
    if not needed:
        pytest.skip(f"rotary_fp32 does not apply here: {reason}")
    result, code, output = probe("rotary", with_positions(tiny_llama, 4096), off="rotary_fp32")
    assert code == 0, output[-3000:]
    assert result["max_error"] > 1e-2, result


@pytest.mark.slow
def test_the_loader_builds_runs_and_trains_one_zero3_step_and_exports_the_original_config(tiny_llama):
    result, code, output = probe("train-step", tiny_llama)
    assert code == 0, output[-3000:]
    assert result["param_dtype"] == "torch.bfloat16"
    assert 0 < result["loss"] < 10 and result["weight_change"] > 0
    assert result["exported_logits_finite"]
    # max_len 32 < 64 positions: capped while training where 4.38 needs it, never in the export.
    assert result["exported_max_position_embeddings"] == result["source_max_position_embeddings"] == 64
    assert result["loaded_max_position_embeddings"] == (32 if causal_mask_cap_applies() else 64)


@pytest.mark.slow
def test_200k_positions_initialise_under_zero3_without_a_positions_squared_buffer(tiny_llama):
    # Under a 4 GiB address-space limit: a 200000^2 causal mask (40 GB) cannot even be attempted.
    result, code, output = probe("positions", with_positions(tiny_llama, 200_000))
    assert code == 0, output[-3000:]
    assert result["peak_rss_growth_bytes"] < 2**30, result
    assert result["buffer_bytes"] < 256 * 2**20, result


@pytest.mark.slow
def test_causal_mask_cap_is_needed_where_it_applies(tiny_llama):
    if not causal_mask_cap_applies():
        pytest.skip(f"transformers {compat.versions()['transformers']} registers no causal_mask buffer")
    result, code, output = probe("positions", with_positions(tiny_llama, 200_000), off="causal_mask_cap")
    assert code != 0 and result is None
    attempted = re.search(r"tried to allocate (\d+) bytes", output)
    assert attempted and int(attempted.group(1)) >= 200_000**2, output[-3000:]


@pytest.mark.slow
def test_a_released_frozen_model_is_freed_with_and_without_a_zero3_engine(tiny_llama):
    # The DPO precompute releases its reference before the policy loads: whatever still holds it
    # (DeepSpeed's hooks, its globals) keeps a whole copy of the weights for the rest of the stage.
    result, code, output = probe("release", tiny_llama)
    assert code == 0, output[-3000:]
    assert result == {"zero2": [], "zero3": []}
    assert output.count("LlamaForCausalLM released: its weights are freed") == 2


# --------------------------------------------------------------------------- logits and packed flash attention


def test_training_passes_return_logits_in_the_model_dtype_with_the_same_values(tiny_llama):
    from transformers import AutoModelForCausalLM

    from stages import data, models

    model, _ = pretrained.from_pretrained(AutoModelForCausalLM, str(tiny_llama), torch.bfloat16, "sdpa", 48)
    tokenizer = models.load_tokenizer(str(tiny_llama))
    row = data.tokenize_sft({"prompt": "sort 21 =", "response": " 12"}, tokenizer, data.DataSpec(path="x.jsonl"), 48)
    batch = data.padded_batch([row], tokenizer.pad_token_id)
    with torch.no_grad():
        logits = batch.forward(model).logits  # no cache, no labels: what the stages pass
        own = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # transformers' own path
    assert logits.dtype == torch.bfloat16  # no (tokens x vocab) fp32 copy on any stack
    torch.testing.assert_close(logits.float(), own.float(), rtol=0, atol=0)


def test_packed_flash_attention_on_transformers_4_38_calls_the_varlen_kernel_per_sequence(tiny_llama, monkeypatch):
    """transformers 4.38's flash attention reads no packed sequences from positions; the
    flash_varlen patch hands flash_attn_varlen_func the sequence boundaries. flash-attn needs
    CUDA, so a stand-in varlen kernel (causal sdpa per sequence) checks the plumbing here."""
    if not compat._flash_varlen_patch_needed():
        pytest.skip(f"transformers {compat.versions()['transformers']} reads packed sequences from positions")
    from transformers import AutoConfig
    from transformers.models.llama import modeling_llama

    calls = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal):
        calls.append(cu_seqlens_q.tolist())
        out = []
        for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (heads, n, dim)
            ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], 0) for t in (ks, vs))
            out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        return torch.cat(out)

    monkeypatch.setattr(modeling_llama, "flash_attn_varlen_func", varlen, raising=False)
    compat.prepare()
    config = AutoConfig.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    flash = modeling_llama.LlamaFlashAttention2(config, layer_idx=0).eval()
    sdpa = modeling_llama.LlamaSdpaAttention(config, layer_idx=0).eval()
    sdpa.load_state_dict(flash.state_dict())
    lengths = [5, 3, 7]
    sequence = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    hidden = torch.randn(1, sum(lengths), config.hidden_size)
    packed = packed_attention.PackedSequences(sequence)
    with torch.no_grad(), packed_attention.sequences_apart(sequence):
        got = flash(hidden_states=hidden, attention_mask=None, position_ids=positions)[0]
        extra = {"cache_position": torch.arange(sum(lengths))} if "cache_position" in inspect.signature(
            sdpa.forward).parameters else {}  # 4.38 indexes the mask with it; 4.37 has none
        want = sdpa(hidden_states=hidden, attention_mask=packed.additive_mask(hidden.dtype), position_ids=positions,
                    **extra)[0]
    assert calls == [[0, 5, 8, 15]]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
