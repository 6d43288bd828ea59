"""What an estimate is computed from: a stage's settings (Knobs), the machine
(Hardware), the models it holds (ModelUse) and what it computes (Workload,
PPOWorkload). Plain data; no estimates here."""

from __future__ import annotations

from dataclasses import dataclass

from core import families, hardware, kinds
from core.batching import data_parallel, rollout_sequences, token_budget  # torch-free: as the stages batch
from core.deepspeed_settings import offloads_optimizer
from core.kinds import StageKind
from core.shapes import ModelShape

GiB = 1024**3

REFERENCE_PLACEMENTS = ("live", "offload", "precompute")


def vllm_knobs(stage) -> dict:
    """An RL stage's vLLM settings as the plan counts them: where it asks for vllm as its rollout
    engine (auto is decided on the node, by the GPU build there: the plan counts transformers'
    generation)."""
    rl = kinds.rollouts_of(stage)
    if rl is None or rl.engine != "vllm":
        return {}
    return {"vllm_tensor_parallel": rl.vllm.tensor_parallel,
            "vllm_memory_share": rl.vllm.gpu_memory_utilization, "vllm_sleep": rl.vllm.sleep}


@dataclass(frozen=True)
class Knobs:
    """The settings of a stage that memory and time depend on (a stage spec, flattened)."""

    kind: str = "sft"
    precision: str = "bf16"
    zero_stage: int = 2
    optimizer_offload: bool = False
    gradient_checkpointing: bool = False
    checkpoint_offload: bool = False  # checkpointed layer inputs in pinned host memory (stages/checkpoint_offload.py)
    attention: str = "auto"
    lora_rank: int | None = None
    lora_targets: tuple = ()
    max_len: int = 2048
    micro_batch_size: int = 1
    packing: bool = True
    micro_batch_tokens: int | None = None
    global_batch_size: int | None = None
    epochs: int = 1
    max_steps: int | None = None
    nodes: int = 1
    reference: str | None = "live"  # dpo, ppo: where the frozen reference waits; None: ppo holds none
    sequence_parallel: int = 1  # processes sharing each micro batch's sequences (Ulysses)
    logits_tile: int | None = None  # positions whose logits the LM head computes at once (None: all)
    mlp_tiles: int | None = None  # tiles each MLP runs a micro batch's positions in (None: all at once)
    # ppo with generation: vllm (pipeline/plan/rollout_engine.py): its tensor_parallel (None: transformers
    # samples), the share of each GPU it takes, and whether it sleeps while the actor trains.
    vllm_tensor_parallel: int | None = None
    vllm_memory_share: float = 0.3
    vllm_sleep: bool = False

    @classmethod
    def from_stage(cls, stage) -> Knobs:
        lora = stage.lora
        return cls(
            kind=stage.kind,
            precision=stage.precision,
            zero_stage=stage.zero_stage,
            optimizer_offload=bool(stage.optimizer_offload),
            gradient_checkpointing=bool(stage.gradient_checkpointing),
            checkpoint_offload=bool(stage.checkpoint_offload),
            attention=stage.attention,
            lora_rank=lora.rank if lora else None,
            lora_targets=tuple(lora.target_modules) if lora else (),
            max_len=stage.max_len,
            micro_batch_size=stage.micro_batch_size,
            packing=stage.packing,
            micro_batch_tokens=stage.micro_batch_tokens,
            global_batch_size=stage.global_batch_size,
            epochs=stage.epochs,
            max_steps=stage.max_steps,
            nodes=stage.nodes,
            reference=reference_placement(stage),
            sequence_parallel=stage.sequence_parallel,
            logits_tile=stage.logits_tile,
            mlp_tiles=stage.mlp_tiles,
            **vllm_knobs(stage),
        )

    @property
    def samples_with_vllm(self) -> bool:
        return self.vllm_tensor_parallel is not None

    @property
    def weight_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def offloads(self) -> bool:
        """DeepSpeed offloads the optimizer only with ZeRO 1-3 (core/deepspeed_settings.py)."""
        return offloads_optimizer(self.optimizer_offload, self.zero_stage)

    @property
    def stage_kind(self) -> StageKind:
        return kinds.get(self.kind)

    def data_parallel(self, processes: int) -> int:
        """Of `processes`, how many train on different rows (core/batching.py data_parallel);
        ValueError when sequence_parallel does not divide them."""
        return data_parallel(processes, self.sequence_parallel)

    @property
    def packs(self) -> bool:
        """Kinds that read their rows pack micro batches by a token budget unless packing is off;
        a rollout's sequences are batched by length."""
        return self.packing and self.stage_kind.packs


def reference_placement(stage) -> str | None:
    """Where a stage's frozen reference waits (kinds that keep one; "live" for the others, which
    hold none), or None for one that needs none (PPOStage.needs_reference: no KL term)."""
    if not kinds.get(stage.kind).frozen_reference:
        return "live"
    return stage.reference if stage.needs_reference else None


def attention_kernel(attention: str, on_gpu: bool, shape: ModelShape) -> str:
    """The attention a stage runs the model of `shape` with: auto is the fastest its family supports
    (flash_attention_2 on GPUs, where the images install it; else sdpa, else eager), as the stage
    decides (core/families.py attention_kernel)."""
    return families.attention_kernel(attention, shape.model_type, on_gpu,
                                     transformers_version=families.installed_transformers())


def masked_line_width(tokens: int, max_len: int) -> int:
    """The widest line a packed micro batch of `tokens` tokens can be laid out in for sdpa and
    eager attention (core/batching.py line_tokens, pack_lines): lines about as long as the
    longest sequence, at most max_len, wider when a few long sequences will not share lines
    evenly, up to about twice that. Memory is planned for rows of max_len: this bound."""
    return min(tokens, 2 * max_len)


@dataclass(frozen=True)
class Hardware:
    """What a stage runs on. Host RAM per node is Slurm's cluster.mem when it names a
    size, else a typical node of the GPU type (core/hardware.py); GPU memory is the
    catalogue's usable memory, read as GiB (binary, as torch and nvidia-smi count)."""

    gpu: hardware.GPU | None
    gpus_per_node: int
    processes_per_node: int
    gpu_memory_bytes: int | None
    host_memory_bytes: int | None
    host_memory_source: str = ""
    cores_per_process: int | None = None  # cluster.cpus_per_task; None: not said (rates.py assumes)
    calibration: object | None = None  # core/calibration.py's measurements of this node, if any

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @classmethod
    def from_cluster(cls, cluster) -> Hardware:
        gpu = hardware.gpu(cluster.gpu) if getattr(cluster, "gpu", None) else None
        gpus_per_node = getattr(cluster, "gpus_per_node", 0) or 0
        processes = (getattr(cluster, "processes_per_node", None) or getattr(cluster, "tasks_per_node", None)
                     or gpus_per_node or 1)
        host_bytes, source = None, ""
        if _slurm_mem_bytes(getattr(cluster, "mem", None)):
            host_bytes, source = _slurm_mem_bytes(cluster.mem), f"cluster.mem ({cluster.mem})"
        elif gpu is not None:
            host_bytes, source = int(gpu.host_memory_gib * GiB), f"typical {gpu.name} node"
        return cls(gpu, gpus_per_node, processes, gpu.memory_bytes if gpu else None, host_bytes, source,
                   getattr(cluster, "cpus_per_task", None))


def _slurm_mem_bytes(mem: str | None) -> int | None:
    """Slurm --mem (default unit MB; K/M/G/T suffixes); 0 means the whole node: unknown here."""
    if not mem:
        return None
    text = str(mem).strip().upper()
    unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1])
    number = float(text[:-1] if unit else text)
    return int(number * (unit or 2**20)) or None


@dataclass(frozen=True)
class ModelUse:
    """One model a stage holds: trained (policy, reward model, critic) or frozen (reference, reward)."""

    role: str
    shape: ModelShape
    head: str = "lm"  # "lm" (next-token logits) or "scalar" (reward / value)
    trained: bool = True
    placement: str = "live"  # frozen models: live (on the GPUs), offload (host RAM), precompute (not at all)


@dataclass(frozen=True)
class Generation:
    """PPO rollouts: sequences generated per GPU at once, prompt and new tokens."""

    batch: int
    prompt_len: int
    new_tokens: int


@dataclass(frozen=True)
class Workload:
    """What a stage computes. A row is a training example (SFT: one sequence; RM/DPO: a
    chosen/rejected pair; PPO: a prompt with its sampled completions)."""

    sequences_per_row: int
    seq_len: int
    generation: Generation | None = None
    # PPO: sequences per micro batch are counted directly (not rows), each rollout of
    # rows_per_rollout prompts is trained train_passes times, and the frozen models (and a
    # no-grad pass of the trained ones) score it scoring_batch sequences at a time.
    micro_batch_in_sequences: bool = False
    train_passes: int = 1
    scoring_batch: int | None = None
    rows_per_rollout: int | None = None

    @property
    def sequences_per_rollout(self) -> int:
        """RL: the sequences one rollout samples, over all processes (core/batching.py)."""
        assert self.rows_per_rollout is not None, "an RL workload has rows_per_rollout (estimate.py stage_models)"
        return rollout_sequences(self.rows_per_rollout, self.sequences_per_row)

    def group_tokens(self, knobs: Knobs) -> int:
        """The most tokens a micro batch holds: the packing budget (stages/data.py token_budget),
        or micro_batch_size rows padded to max_len. Its sequence_parallel processes share it."""
        if self.micro_batch_in_sequences:
            return knobs.micro_batch_size * self.seq_len
        if knobs.packs:
            return token_budget(knobs, self.sequences_per_row)
        return knobs.micro_batch_size * self.sequences_per_row * self.seq_len

    def train_tokens(self, knobs: Knobs) -> int:
        """The most positions one process runs per micro batch: its 1/sequence_parallel of the
        micro batch (the lines widened to a multiple of it: stages/sequence_parallel.py)."""
        return -(-self.group_tokens(knobs) // knobs.sequence_parallel)

    def scoring_tokens(self, knobs: Knobs) -> int:
        """The most positions one process runs per scoring pass (PPO: its 1/sequence_parallel of
        scoring_batch sequences, as in training)."""
        if not self.scoring_batch:
            return self.train_tokens(knobs)
        return -(-self.scoring_batch * self.seq_len // knobs.sequence_parallel)


@dataclass(frozen=True)
class PPOWorkload:
    """What a PPO stage holds besides its actor and how it rolls out (stages/ppo.py):
    the reward model's and critic's shapes (None when absent), where the reward model
    waits between uses, completions per prompt, prompts per rollout, sequences per
    generation call and scoring pass, the longest completion, and passes over each
    rollout. None fields take the stage's micro batch size / half its max_len."""

    reward_shape: ModelShape | None = None
    critic_shape: ModelShape | None = None
    reward_placement: str = "live"
    samples_per_prompt: int = 1
    rollout_rows: int | None = None
    scoring_batch: int | None = None
    new_tokens: int | None = None
    train_passes: int = 1
