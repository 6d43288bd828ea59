"""Loading the models a stage trains or consults: tokenizer, causal LM, LoRA,
attention kernel, gradient checkpointing, ZeRO-3 sharded construction."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from core import families, tiny
from core.config import BUILTIN_PREFIX
from core.errors import InvalidInput
from stages import compat, loaded_weights, pretrained, watchdog

log = logging.getLogger("stages")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The output heads of the two kinds of model the stages build (stages/loaded_weights.py): one built as
# the other kind takes its own new and leaves the folder's behind.
LM_HEAD, SCORE_HEAD = "lm_head", "score"

# transformers reads the DeepSpeed config from a live HfDeepSpeedConfig when it
# builds a model: with ZeRO-3 it then constructs every weight already sharded.
_live_ds_configs: list = []


def resolve(model: str, builtin_root: Path) -> str:
    """A loadable path or hub id for what the spec names (builtin:NAME is written first)."""
    if model.startswith(BUILTIN_PREFIX):
        return str(tiny.materialize(model[len(BUILTIN_PREFIX):], builtin_root))
    return model


def shape_of(path: str):
    """The model's architecture as the planner reads it (core/shapes.py), for its FLOPs."""
    from core.shapes import resolve_shape

    return resolve_shape(path)


def lora_params(model):
    """Trained parameters of a LoRA model (its adapters); None when all parameters train."""
    if not hasattr(model, "peft_config"):
        return None
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)  # ZeRO-3: whole size


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise InvalidInput(f"model {path}: cannot load its tokenizer: {err}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # right padding; padded positions are masked
    tokenizer.padding_side = "right"
    return tokenizer


def attention_implementation(requested: str, on_gpu: bool, path: str) -> str:
    """The attention kernel the model at `path` runs, by the rule the planner uses (core/families.py
    attention_kernel): auto is the fastest its family supports here; an explicit kernel its family
    refuses is refused (validate says so before anything starts; a container's stage says it here)."""
    import transformers

    model_type = transformers.AutoConfig.from_pretrained(path).model_type
    refusal = families.attention_refusal(requested, model_type, transformers.__version__)
    if refusal:
        raise InvalidInput(f"attention: model {path}: {refusal}")
    return families.attention_kernel(requested, model_type, on_gpu, importlib.util.find_spec("flash_attn") is not None,
                                     transformers.__version__)


def load_pretrained(auto_class, path: str, stage, ds_config: dict, on_gpu: bool, adds_head: str | None = None,
                    drops_head: str | None = None, **kwargs):
    """from_pretrained with the stage's dtype, attention kernel and ZeRO-3 sharding, through
    stages/pretrained.py (argument names and load-time patches of the installed transformers). Refuses
    a folder whose weights are not all and only the model's (stages/loaded_weights.py), but for
    `adds_head` and `drops_head`: the head this call adds, and the one it leaves out, where the
    folder was saved as another class."""
    if stage.zero_stage == 3:
        _live_ds_configs.append(compat.hf_deepspeed_config(ds_config))
    attention = attention_implementation(stage.attention, on_gpu, path)
    log.info("loading %s (%s)", path, auto_class.__name__)
    try:
        model, report = pretrained.from_pretrained(auto_class, path, DTYPES[stage.precision], attention,
                                                   stage.max_len, **kwargs)
    except pretrained.DamagedWeights as err:
        raise InvalidInput(f"model {path}: {err}: a weights file is cut short or damaged (`python -m pipeline "
                           "validate` names it); download or save the model again") from None
    except FileNotFoundError as err:
        raise InvalidInput(f"model {path}: cannot load: {err}: a file of the model is missing (a shard its index "
                           "names?); download or save the model again") from None
    except (OSError, ValueError) as err:
        raise InvalidInput(f"model {path}: cannot load: {err}") from None
    loaded_weights.refuse_unless_given(path, report, adds_head, drops_head)
    log.info("loaded %s from %s (%s, attention=%s)", type(model).__name__, path, stage.precision, attention)
    if getattr(stage, "mlp_tiles", None):
        tile_mlps(model, stage.mlp_tiles)
        log.info("mlp_tiles %d: every decoder layer's MLP runs a micro batch's positions in %d tiles",
                 stage.mlp_tiles, stage.mlp_tiles)
    return model


def tile_bounds(positions: int, tiles: int) -> list[tuple[int, int]]:
    """(start, stop) of `tiles` tiles over `positions` positions, the first ones a position longer
    where they do not divide; always `tiles` of them, empty ones where positions are fewer."""
    size, longer = divmod(positions, tiles)
    stops = [(i + 1) * size + min(i + 1, longer) for i in range(tiles)]
    return list(zip([0] + stops[:-1], stops))


class _TiledMLP(torch.autograd.Function):
    """mlp(x) over `tiles` tiles of x's positions, each position's output its own (an MLP mixes
    no positions). The forward keeps only x; the backward runs each tile's MLP again and
    backpropagates it on its own, so one tile's intermediates (gate, up, their product, and
    their gradients) exist at a time, as in DeepSpeed's TiledMLP (ulysses_sp.py).

    Every call makes exactly `tiles` calls of the MLP, in the forward and in the backward, empty
    tiles included: under ZeRO-3 each call gathers the MLP's weights from all processes, whose
    lines may be of different widths. ZeRO reduces a weight's gradient when told it is ready
    (`ds_grad_is_ready`): the MLP's trained weights are marked ready at the last tile only, so
    each is reduced once, whole.
    """

    @staticmethod
    def forward(ctx, x, mlp, tiles: int, trained: tuple):
        ctx.mlp, ctx.tiles, ctx.trained = mlp, tiles, trained
        ctx.save_for_backward(x)
        flat = x.reshape(1, -1, x.shape[-1])
        out = torch.cat([mlp(flat[:, a:b]) for a, b in tile_bounds(flat.shape[1], tiles)], dim=1)
        return out.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(1, -1, x.shape[-1])
        grads, grad_x = grad_out.reshape(flat.shape), torch.zeros_like(flat)
        bounds = tile_bounds(flat.shape[1], ctx.tiles)
        for i, (a, b) in enumerate(bounds):
            for param in ctx.trained:
                param.ds_grad_is_ready = i == len(bounds) - 1
            piece = flat[:, a:b].detach().requires_grad_(True)
            with torch.enable_grad():
                out = ctx.mlp(piece)
            torch.autograd.backward(out, grads[:, a:b])
            if piece.grad is not None:
                grad_x[:, a:b] = piece.grad
        for param in ctx.trained:
            param.ds_grad_is_ready = True
        return grad_x.view_as(x), None, None, None


def tiled_mlp(mlp, x: torch.Tensor, tiles: int, trained=()) -> torch.Tensor:
    """mlp(x), with `mlp` (a position-wise module's plain forward) run on `tiles` tiles of x's
    positions in the forward and again in the backward (_TiledMLP). `trained`: the weights it
    trains, for DeepSpeed's gradient bucketing (empty without DeepSpeed)."""
    if tiles < 1:
        raise ValueError(f"tiles must be at least 1, got {tiles}")
    trained = tuple(trained)
    if trained and torch.is_grad_enabled() and not x.requires_grad:
        # The weights' gradients come out of this function's backward, which autograd runs only
        # for an input that needs a gradient (e.g. the first layer's MLP with LoRA on the MLP only).
        x = x.detach().requires_grad_(True)
    return _TiledMLP.apply(x, mlp, tiles, trained)


def tile_mlps(model, tiles: int) -> int:
    """Run every decoder layer's MLP (`layer.mlp`, Llama-style) in `tiles` tiles of positions
    (tiled_mlp); LoRA adapters added later are inside it. Returns the MLPs tiled."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(base.get_decoder(), "layers", None)
    mlps: list[Any] = [getattr(layer, "mlp", None) for layer in layers or ()]
    if not mlps or any(mlp is None for mlp in mlps):
        raise InvalidInput(f"mlp_tiles: {type(base).__name__} has no `mlp` in each decoder layer to tile (Llama-"
                           "style models have); leave mlp_tiles out")
    for mlp in mlps:
        plain = mlp.forward

        def forward(x, plain=plain, mlp=mlp):
            return tiled_mlp(plain, x, tiles, [p for p in mlp.parameters() if p.requires_grad])

        mlp.forward = forward
    return len(mlps)


def prepare_for_training(model, stage, task_type: str, modules_to_save=None):
    """Gradient checkpointing and LoRA adapters, as the stage asks."""
    if stage.gradient_checkpointing:
        compat.enable_checkpointing(model)
        model.config.use_cache = False
        if stage.checkpoint_offload:
            from stages import checkpoint_offload

            layers = checkpoint_offload.enable(model)
            log.info("checkpoint_offload: the checkpointed inputs of %d module(s) wait in host memory", layers)
    if stage.lora:
        from peft import LoraConfig, get_peft_model

        if stage.gradient_checkpointing:
            model.enable_input_require_grads()
        lora = LoraConfig(
            r=stage.lora.rank,
            lora_alpha=stage.lora.alpha,
            lora_dropout=stage.lora.dropout,
            target_modules=list(stage.lora.target_modules),
            modules_to_save=modules_to_save,
            task_type=task_type,
        )
        model = get_peft_model(model, lora)
        # peft builds adapters in fp32. DeepSpeed casts whole modules to the training
        # dtype itself, except under ZeRO-3, whose sharded weights it leaves alone:
        # there the fp32 adapters beside bf16 weights (and a bf16 `score` copy) break
        # its flat buffers. Cast whatever is not sharded, on every ZeRO stage alike.
        dtype = DTYPES[stage.precision]
        for param in model.parameters():
            if not hasattr(param, "ds_id") and param.dtype != dtype:
                param.data = param.data.to(dtype)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info("LoRA r=%d: %d trainable parameters", stage.lora.rank, trainable)
    return model


@watchdog.phase(watchdog.LOADING)
def load_causal_lm(path: str, stage, ds_config: dict, on_gpu: bool):
    """A causal LM; from a reward model's export (tied embeddings: its LM head is the embedding), the
    score head stays behind."""
    from transformers import AutoModelForCausalLM

    model = load_pretrained(AutoModelForCausalLM, path, stage, ds_config, on_gpu, drops_head=SCORE_HEAD)
    return prepare_for_training(model, stage, "CAUSAL_LM")


@watchdog.phase(watchdog.LOADING)
def load_reward_model(path: str, stage, ds_config: dict, on_gpu: bool, pad_token_id: int):
    """A 1-label sequence classifier; its score head is new when starting from a causal LM, and must be
    in the folder when starting from a reward model."""
    from transformers import AutoModelForSequenceClassification

    model = load_pretrained(AutoModelForSequenceClassification, path, stage, ds_config, on_gpu, adds_head=SCORE_HEAD,
                            drops_head=LM_HEAD, num_labels=1)
    # The reward is read at the last token that is not padding: the model must know the pad id.
    model.config.pad_token_id = pad_token_id
    return prepare_for_training(model, stage, "SEQ_CLS", modules_to_save=[SCORE_HEAD])


def score_head(model):
    """The scalar head of a sequence classifier (reward model, critic), inside peft's wrapper if any."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.score


class _Output:
    value: Any = None


@contextlib.contextmanager
def output_of(module):
    """Capture what `module` returns during the forward passes run inside (the last one):
    e.g. a classifier head's score at every position, before transformers picks one."""
    captured = _Output()

    def keep(_module, _inputs, output):
        captured.value = output

    handle = module.register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def position_scores(model, batch):
    """(lines, width): a scalar head's output at every position of `batch` under `model` (a reward
    model or critic: a DeepSpeed engine or a FrozenModel), read from the head before transformers
    picks a position; a shared batch's whole lines (stages/sequence_parallel.py)."""
    with output_of(score_head(model.module)) as scores:
        batch.forward(model)
    return batch.gathered(scores.value.squeeze(-1).float())


def sequence_scores(model, batch, pad_id: int):
    """(sequences,): each sequence's score under a sequence classifier: the head's output at the
    token transformers' classifier reads (its last token that is not the pad id), so a model scores
    as it was trained, packed, padded or shared."""
    return position_scores(model, batch).reshape(-1)[batch.last_tokens(skip_id=pad_id)]


def next_token_logprobs(model, batch, tile: int | None = None):
    """(lines, width - 1): the log-prob of each next response token of `batch` under `model` (a
    DeepSpeed engine or a FrozenModel), as Batch.logprobs gives. With `tile`, the LM head runs on
    that many positions at a time (stages/losses.py tiled_next_token_logprobs), read from the
    decoder's output while the model runs (the head itself is asked for no position)."""
    if tile is None:
        return batch.logprobs(batch.forward(model).logits)
    from stages.losses import tiled_next_token_logprobs

    module = model.module
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    trained = [p for p in head.parameters() if p.requires_grad]
    shared = {id(p) for p in embedding.parameters()}
    targets, mask = batch.next_targets()
    found = _Output()

    def tiled(_module, _inputs, output):
        # Inside the decoder's forward, where an offloaded frozen model is still on the device.
        states = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        found.value = tiled_next_token_logprobs(head, states, targets, mask, tile,
                                                untied=[p for p in trained if id(p) not in shared],
                                                tied=[p for p in trained if id(p) in shared])

    handle = base.get_decoder().register_forward_hook(tiled)
    try:
        batch.forward(model, logits_to_keep=torch.zeros(0, dtype=torch.long, device=targets.device))
    finally:
        handle.remove()
    return batch.gathered(found.value)[:, :-1]


class FrozenModel:
    """A model that is only consulted (DPO/PPO reference, PPO reward model).

    live: on the device; under ZeRO-3 a DeepSpeed engine shards it like the policy.
    offload: in host RAM between uses; under ZeRO-3 DeepSpeed's parameter offload,
    otherwise moved to the device for each call and back.
    """

    def __init__(self, module, device, offload: bool, engine=None):
        self.module, self.device, self.offload, self.engine = module, device, offload, engine
        # Seconds spent moving it to the device and back (offload without ZeRO-3; under ZeRO-3
        # DeepSpeed moves it inside the forward, where it cannot be told apart): RL's offload_s.
        self.moved_s = 0.0
        module.eval()
        module.requires_grad_(False)
        if engine is None:
            module.to("cpu" if offload else device)

    @torch.no_grad()
    def __call__(self, **inputs):
        if self.engine is not None:
            return self.engine(**inputs)
        if self.offload:
            self._move(self.device)
        try:
            return self.module(**inputs)
        finally:
            if self.offload:
                self._move("cpu")

    def _move(self, device) -> None:
        started = time.perf_counter()
        self.module.to(device)
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)  # the copy is queued, not done, when .to returns
        self.moved_s += time.perf_counter() - started

    def release(self) -> None:
        """Free its memory (precomputed references need it no longer), and log whether it was."""
        model, name = weakref.ref(self.module), type(self.module).__name__
        if self.engine is not None:
            compat.destroy_zero3_engine(self.engine)
        self.module = self.engine = None
        gc.collect()  # the model, its hooks and engine refer to each other
        if model() is None:
            log.info("%s released: its weights are freed", name)
        else:
            log.warning("%s released, but something still holds it: its weights stay in memory", name)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@watchdog.phase(watchdog.LOADING)
def load_frozen(auto_class, path: str, stage, frozen_config: dict, device, offload: bool, **kwargs) -> FrozenModel:
    import deepspeed

    model = load_pretrained(auto_class, path, stage, frozen_config, device.type == "cuda", **kwargs)
    if stage.zero_stage == 3:
        engine, *_ = deepspeed.initialize(model=model, config=frozen_config)
        return FrozenModel(model, device, offload, engine=engine)
    return FrozenModel(model, device, offload)
