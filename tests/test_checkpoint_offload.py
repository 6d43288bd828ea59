"""checkpoint_offload (stages/checkpoint_offload.py): checkpointed layer inputs in host memory, the
same loss and gradients as the plain checkpointing path. On one model, every parameter's gradient;
through the stages, under ZeRO-3 with 2 processes sharing every sequence, every logged figure and
the trained weights (rel 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch

from stages import checkpoint_offload
from tests.conftest import read_metrics, read_result
from tests.sharing_support import needs_the_stack, ran, sharing_pipeline

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)


def _gradients(offload: bool, monkeypatch=None) -> tuple[float, dict]:
    from stages import compat

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.float64).train()
    compat.enable_checkpointing(model)
    if offload:
        assert checkpoint_offload.enable(model) >= 1
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_offloaded_checkpoints_give_the_plain_paths_loss_and_every_gradient(monkeypatch):
    copies = []
    to_host = checkpoint_offload._to_host
    monkeypatch.setattr(checkpoint_offload, "_to_host", lambda t: copies.append(t.shape) or to_host(t))
    plain_loss, plain = _gradients(offload=False)
    loss, offloaded = _gradients(offload=True)
    assert copies == [torch.Size([2, 24, TINY["hidden_size"]])] * TINY["num_hidden_layers"]  # each layer's input
    assert loss == plain_loss
    assert plain.keys() == offloaded.keys() and all(g.abs().sum() > 0 for g in plain.values())
    for name, grad in plain.items():
        assert torch.allclose(offloaded[name], grad, rtol=1e-10, atol=1e-14), name


def test_a_model_without_checkpointed_layers_is_refused():
    with pytest.raises(ValueError, match="no checkpointed layers"):
        checkpoint_offload.enable(torch.nn.Linear(2, 2))


def test_checkpoint_offload_needs_gradient_checkpointing():
    from core.schemas.sft import SFTStage

    with pytest.raises(ValueError, match="checkpoint_offload .* needs gradient_checkpointing: true"):
        SFTStage.model_validate({"name": "s", "kind": "sft", "model": "builtin:tiny-llama",
                                 "data": {"path": "builtin:digits"}, "checkpoint_offload": True})


# --------------------------------------------------------------------------- through the stages


def _figures(folder) -> dict:
    return {(r["step"], k): v for r in read_metrics(folder) for k, v in r.items()
            if k in ("loss", "grad_norm", "eval_loss") and isinstance(v, (int, float))}


def _weights(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted((folder / "model").glob("*.safetensors")) for k, v in load_file(f).items()}


@needs_the_stack
@pytest.mark.e2e
def test_under_zero3_with_shared_sequences_it_learns_what_the_plain_path_learns(tmp_path):
    spec = sharing_pipeline(2, 2, ("sft",), name="offload")
    plain = {**spec["stages"][0], "name": "plain", "zero_stage": 3, "gradient_checkpointing": True}
    spec["stages"] = [plain, {**plain, "name": "offloaded", "checkpoint_offload": True}]
    runs = ran(tmp_path, spec)
    a, b = _figures(runs / "plain"), _figures(runs / "offloaded")
    assert a.keys() == b.keys() and {name for _, name in a} >= {"loss", "grad_norm"}
    assert all(math.isclose(a[k], b[k], rel_tol=1e-5) for k in a), {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    weights = _weights(runs / "plain"), _weights(runs / "offloaded")
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        assert torch.allclose(weights[1][name], value, rtol=1e-5, atol=1e-7), name
    assert read_result(runs / "offloaded")["world_size"] == 2
    log = next((runs / "offloaded" / "logs").glob("*_0_log.out")).read_text()
    assert "checkpoint_offload: the checkpointed inputs of" in log, log[-2000:]
