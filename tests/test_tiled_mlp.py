"""A tiled MLP (stages/models.py tiled_mlp, mlp_tiles): each decoder layer's MLP run over tiles of
positions gives the outputs and gradients of the whole one, with the same number of MLP calls
whatever the width, and tells ZeRO a weight's gradient is whole at the last tile only.

Float64 on CPU, no DeepSpeed: tests/test_sequence_parallel.py runs the tiled stages on DeepSpeed.
"""

from __future__ import annotations

import pytest
import torch

from stages import compat
from stages.models import tile_bounds, tile_mlps, tiled_mlp


class MLP(torch.nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, width=6, inner=10):
        super().__init__()
        self.gate = torch.nn.Linear(width, inner, bias=False, dtype=torch.float64)
        self.up = torch.nn.Linear(width, inner, bias=False, dtype=torch.float64)
        self.down = torch.nn.Linear(inner, width, bias=False, dtype=torch.float64)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("positions,tiles", [(9, 4), (10, 5), (3, 7)])
def test_tiles_cover_the_positions_in_exactly_that_many_pieces(positions, tiles):
    bounds = tile_bounds(positions, tiles)
    assert len(bounds) == tiles and bounds[0][0] == 0 and bounds[-1][1] == positions
    assert all(a <= b and b == c for (a, b), (c, _) in zip(bounds, bounds[1:]))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


def test_a_tiled_mlp_gives_the_outputs_and_gradients_of_the_whole_one():
    torch.manual_seed(0)
    mlp = MLP()
    x0, weights = torch.randn(2, 9, 6, dtype=torch.float64), torch.randn(2, 9, 6, dtype=torch.float64)

    def run(tiles):
        mlp.zero_grad()
        x = x0.clone().requires_grad_(True)
        out = tiled_mlp(mlp.forward, x, tiles, [p for p in mlp.parameters()]) if tiles else mlp(x)
        (out * weights).sum().backward()
        return [out.detach(), x.grad] + [p.grad.clone() for p in mlp.parameters()]

    whole = run(None)
    for tiles in (1, 4, 7, 18, 25):
        for got, expected in zip(run(tiles), whole):
            assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12), tiles


@pytest.mark.parametrize("width", [1, 5, 37])
def test_every_width_makes_the_same_mlp_calls(width):
    """Under ZeRO-3 each call gathers the weights from every process: processes whose lines
    differ in width must still call the MLP as often (empty tiles included)."""
    mlp = MLP()
    x = torch.randn(1, width, 6, dtype=torch.float64, requires_grad=True)
    out = tiled_mlp(mlp.forward, x, 4, list(mlp.parameters()))
    assert mlp.calls == 4
    out.sum().backward()
    assert mlp.calls == 8 and x.grad.shape == x.shape


def test_the_weights_are_whole_only_at_the_last_tile():
    """ZeRO reduces a gradient when the weight says it is ready (ds_grad_is_ready): once, after
    the last tile's gradient has been added."""
    mlp = MLP()
    seen = []
    mlp.down.weight.register_hook(lambda grad: seen.append(mlp.down.weight.ds_grad_is_ready))
    x = torch.randn(1, 8, 6, dtype=torch.float64, requires_grad=True)
    tiled_mlp(mlp.forward, x, 4, list(mlp.parameters())).sum().backward()
    assert seen == [False, False, False, True] and mlp.down.weight.ds_grad_is_ready


@pytest.mark.parametrize("lora,checkpointing", [(False, True), (True, False)],
                         ids=["checkpointed", "lora-on-the-mlp"])
def test_a_tiled_model_learns_what_the_plain_one_does(lora, checkpointing):
    """A tiny Llama with its MLPs tiled (tile_mlps): the same loss and gradients, with gradient
    checkpointing, and with LoRA on the MLP only (the first MLP's input then needs no gradient)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=23, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, 23, (2, 11), generator=torch.Generator().manual_seed(1))

    def run(tiles):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float64)
        if tiles:
            assert tile_mlps(model, tiles) == 2
        if checkpointing:
            compat.enable_checkpointing(model)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "down_proj"],
                                                     init_lora_weights=False))
        model.train()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        assert all(g is not None for g in grads.values())
        return loss.detach(), grads

    loss, grads = run(None)
    tiled_loss, tiled_grads = run(3)
    assert torch.allclose(tiled_loss, loss, rtol=1e-12)
    assert grads.keys() == tiled_grads.keys()
    for name in grads:
        assert torch.allclose(tiled_grads[name], grads[name], rtol=1e-10, atol=1e-12), name
