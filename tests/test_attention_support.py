"""Attention kernels by family (core/families.py): the table validate reads without torch agrees
with the installed transformers' own class flags, auto never picks a kernel a family refuses, and
an explicit kernel the model refuses is refused before anything starts (exit 2, the field named)."""

from __future__ import annotations

import json

import pytest

from core import families
from tests.conftest import tiny_pipeline
from tests.test_cli_bad_input import run_rejected

transformers = pytest.importorskip("transformers")
from transformers.models.auto import modeling_auto  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def _classes(model_type: str) -> list:
    """The classes the stages load a family with: causal LM (sft, dpo, ppo) and sequence classifier (rm)."""
    found = []
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES):
        name = mapping.get(model_type)
        if name is not None and hasattr(transformers, name):
            found.append(getattr(transformers, name))
    if not found:
        pytest.skip(f"transformers {transformers.__version__} has no model_type '{model_type}'")
    return found


def _refused_by(cls) -> set:
    """The kernels a transformers class refuses, by its own flags (4.x names flash _supports_flash_attn_2)."""
    flash = getattr(cls, "_supports_flash_attn", None) or getattr(cls, "_supports_flash_attn_2", False)
    compatible = getattr(cls, "_compatible_flash_implementations", None)
    refused = set() if getattr(cls, "_supports_sdpa", False) else {"sdpa"}
    if not flash or (compatible is not None and "flash_attention_2" not in compatible):
        refused.add("flash_attention_2")
    return refused


COUNTED = [t for t, f in families.FAMILIES.items() if f.counted]


@pytest.mark.parametrize("model_type", COUNTED)
def test_the_table_says_what_transformers_classes_refuse(model_type):
    for cls in _classes(model_type):
        assert families.refused_kernels(model_type, transformers.__version__) == _refused_by(cls), cls.__name__


@pytest.mark.parametrize("model_type", COUNTED)
def test_auto_picks_a_kernel_every_family_supports(model_type):
    for cls in _classes(model_type):
        for on_gpu in (True, False):
            kernel = families.attention_kernel("auto", model_type, on_gpu,
                                               transformers_version=transformers.__version__)
            assert kernel not in _refused_by(cls)


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss", "llama"])
def test_auto_loads_on_this_cpu(model_type):
    refused = set().union(*map(_refused_by, _classes(model_type)))
    kernel = families.attention_kernel("auto", model_type, False, transformers_version=transformers.__version__)
    config = transformers.AutoConfig.for_model(model_type, **TINY)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=kernel)
    assert model.config._attn_implementation == kernel
    assert kernel == ("sdpa" if "sdpa" not in refused else "eager")


def test_a_refusal_holds_from_the_transformers_version_that_made_it():
    assert families.refused_kernels("gemma2", "5.19.0") == set()
    assert families.refused_kernels("gemma2", "5.21.0") == families.refused_kernels("gemma2", "5.23.0") == {"sdpa"}
    assert families.refused_kernels("gemma2", None) == {"sdpa"}  # a version not known: the strictest
    assert families.refused_kernels("gpt_oss", "5.19.0") == {"sdpa", "flash_attention_2"}
    assert families.attention_kernel("auto", "gemma2", False, transformers_version="5.19.0") == "sdpa"
    assert families.attention_kernel("auto", "gemma2", False, transformers_version="5.23.0") == "eager"


def _cached_hub_model(workdir, monkeypatch, model_type: str) -> str:
    """A hub id whose config.json (of `model_type`) is in the Hugging Face cache, as `download` leaves it."""
    repo = workdir / "hub" / f"models--org--tiny-{model_type}"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text(json.dumps({"model_type": model_type, **TINY}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(workdir / "hub"))
    return f"org/tiny-{model_type}"


def test_validate_refuses_a_kernel_the_model_refuses(workdir, monkeypatch):
    spec = tiny_pipeline()
    spec["stages"][0].update(model=_cached_hub_model(workdir, monkeypatch, "gpt_oss"), attention="sdpa")
    run_rejected(workdir, spec, "stages[0] (sft).attention", f"transformers {transformers.__version__} refuses "
                 "sdpa for model_type 'gpt_oss'", "use auto (eager on GPUs, eager on CPU")


def test_the_stage_decides_by_the_same_rule(tmp_path):
    from core.errors import InvalidInput
    from stages import models

    _classes("gpt_oss")
    transformers.AutoConfig.for_model("gpt_oss", **TINY).save_pretrained(tmp_path)
    assert models.attention_implementation("auto", False, str(tmp_path)) == "eager"
    assert models.attention_implementation("eager", False, str(tmp_path)) == "eager"
    with pytest.raises(InvalidInput, match="attention: model .*transformers .* refuses sdpa for model_type 'gpt_oss'"):
        models.attention_implementation("sdpa", False, str(tmp_path))


def test_validate_refuses_shared_sequences_a_family_can_only_run_eagerly(workdir, monkeypatch):
    spec = tiny_pipeline()
    spec["stages"] = spec["stages"][:1]
    spec["stages"][0].update(model=_cached_hub_model(workdir, monkeypatch, "gpt_oss"), sequence_parallel=2)
    run_rejected(workdir, spec, "stages[0] (sft).sequence_parallel", "runs eager attention on CPU")
