"""The supervised recipe: what SFT, RM, DPO (and a plug-in's supervised kind) share, in one
story with named hooks.

A supervised stage reads its rows, tokenises them, loads the model it trains (and any frozen
model it consults), trains it on the engine's loop (stages/engine.py: resume, intervals,
signals, metrics) and exports it. What differs by kind is a few hooks a subclass fills:

- `load_models()`: the trained model (default: a causal LM) and anything frozen beside it;
- `loss(batch, micro, step)`: this micro batch's share of the step's mean loss, and of each metric;
- `evaluate()`: held-out metrics, the same on every process (`eval_sums` does the summing);
- `result(outcome)`: the result.json figures from the loop's initial and final evaluations;
- `export_files(outcome)`: files saved beside the exported model (default: none).

How many sequences a row makes comes from the kind's declaration (core/kinds.py), never from
here. A kind's run is `Recipe.run` of its subclass: `run = SFT.run`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from core import kinds
from core.batching import MicroBatch, Step
from core.flops import sequence_flops
from core.kinds import StageKind
from core.task import StageTask
from stages import collectives, data, engine, export, models

if TYPE_CHECKING:
    from core.config import StageBase
    from stages.runner import StageContext


class Recipe:
    """One supervised stage's run; a subclass fills the hooks (module docstring). What `train` sets up
    is on self for the hooks:"""

    stage: StageBase  # task.stage; a kind's recipe runs on its kind's stages, and says so: `stage: DPOStage`
    tokenizer: Any
    tokenized: data.TokenizedSplits  # the rows tokenised, and what max_len cut
    train_set: data.TokenRows
    eval_set: data.TokenRows
    ds_config: dict  # the trained model's DeepSpeed config
    ds: Any  # the DeepSpeed engine of the trained model

    def __init__(self, task: StageTask, ctx: StageContext) -> None:
        self.task, self.ctx, self.stage = task, ctx, task.stage
        self.kind: StageKind = kinds.get(task.stage.kind)
        self.model_path: str = models.resolve(task.init_model, ctx.builtin_root)

    @classmethod
    def run(cls, task: StageTask, ctx: StageContext) -> dict:
        """The stage job's body (a kind's `run`): data, models, train, export, result."""
        return cls(task, ctx).train()

    def train(self) -> dict:
        stage, ctx = self.stage, self.ctx
        # ---- data
        self.tokenizer = models.load_tokenizer(self.model_path)
        self.tokenized = data.tokenized_splits(stage, self.tokenizer, ctx.builtin_root)
        attention = models.attention_implementation(stage.attention, ctx.on_gpu, self.model_path)
        self.train_set, self.eval_set = (
            data.TokenRows(split.tokens, stage, ctx, self.tokenizer.pad_token_id, attention,
                           sequences_per_row=self.kind.sequences_per_row)
            for split in (self.tokenized.train, self.tokenized.eval))
        # ---- models
        self.ds_config = ctx.deepspeed_config(stage, self.model_path)
        model = self.load_models()
        steps_per_epoch, total_steps = engine.step_counts(len(self.tokenized.train.tokens),
                                                          self.train_set.rows_per_step, stage)
        self.ds = engine.initialize(model, stage, self.ds_config, total_steps)
        self.shape, self.lora = models.shape_of(self.model_path), models.lora_params(model)
        # ---- train, export
        loop = engine.Loop(batch=self.train_set.batch, loss=self.loss, evaluate=self.evaluate,
                           steps=self.train_set.steps, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                           flops=self.flops)
        outcome = engine.train(self.ds, loop, stage, ctx)
        export.export(self.ds, self.tokenizer, stage, ctx.folder.model, ctx.is_main,
                      extra_files=self.export_files(outcome))
        return {**self.result(outcome), "truncation": self.tokenized.record()}

    # ---- hooks
    def load_models(self):
        """The model this stage trains, before DeepSpeed wraps it (and whatever it consults, kept on self)."""
        return models.load_causal_lm(self.model_path, self.stage, self.ds_config, self.ctx.on_gpu)

    def loss(self, batch, micro: MicroBatch, step: Step) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def evaluate(self) -> dict:
        raise NotImplementedError

    def result(self, outcome: dict) -> dict:
        raise NotImplementedError

    def export_files(self, outcome: dict) -> dict:
        """{file name: JSON-able content} saved beside the exported model."""
        return {}

    def flops(self, batch) -> float:
        """Model FLOPs of a training batch (for MFU): a forward and backward of the trained model."""
        return sum(sequence_flops(self.shape, self.kind.trained_head, n, trained=True, lora_params=self.lora)
                   for n in batch.lengths)

    # ---- shared by the hooks
    @torch.no_grad()
    def eval_sums(self, terms: Callable[[object, MicroBatch], list[torch.Tensor]], size: int) -> list[float]:
        """`terms(batch, micro)` (`size` sums of one eval micro batch) summed over the eval split and every
        process, in float64; filler passes count nothing."""
        self.ds.eval()
        sums = torch.zeros(size, dtype=torch.float64, device=self.ctx.device)
        for micro in self.eval_set.eval_micro_batches():
            sums += micro.weight * torch.stack(terms(self.eval_set.batch(micro), micro)).double()
        return collectives.sum_once_per_group(sums).tolist()

    def per_pair(self, step: Step, micro: MicroBatch, losses: torch.Tensor, **metrics: torch.Tensor):
        """A pair kind's loss share and metric shares: sums over this micro batch's pairs, as a share of
        the step's pairs."""
        weight = micro.weight / len(step.rows)
        return losses.sum() * weight, {"loss": losses.detach().sum() * weight,
                                       **{k: v.detach().sum() * weight for k, v in metrics.items()}}
