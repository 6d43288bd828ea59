"""One rollout of RL: sample completions, score them, the frozen models' views of them, advantages.

stages/ppo.py trains on one rollout after another (each a unit of the engine's loop); this module
makes the rollout and hands it over as a typed `Rollout`. Three phases, each timed on the maker's
clock (stages/phases.py; metrics: generate_s, score_s, and inside them gather_s and offload_s):

1. sampling: `generate` (stages/generation.py: padded `generate`, or transformers' continuous
   batching) is the one function that turns prompts into completions. With
   dynamic_sampling, prompts whose samples all got the same reward are dropped and more are
   sampled, up to dynamic_sampling_max_rounds rounds.
2. scoring: rule rewards on the decoded text (core/rewards.py; every column of the row is
   there) plus the reward model's score, normalised when the pipeline file says so.
3. views and advantages: the actor's log-probs at sampling time, the reference's and the KL between
   them (when there is a KL term: PPOStage.needs_reference), the critic's values (gae), and
   advantages from stages/advantages.py over the whole rollout:
   every statistic that spans sequences is summed over processes, so the numbers do not depend on
   how many processes share the rollout or how it is cut into micro batches.

Every process holds the same number of sequences and makes the same collective calls in the
same order (ZeRO-3 gathers parameters collectively), whatever its own samples were.

Shared sequences (sequence_parallel N, stages/sequence_parallel.py): the prompts are split over the
data-parallel groups, and every process of a group holds the group's whole rollout, in the same
order. Sampling stays whole-sequence (attention runs as usual outside a shared batch): each
process of a group samples its 1/N of the group's prompts (whole groups of samples) and the
group gathers the completions (`RolloutMaker.sample`). From there every process of the group
computes the same rewards (rules on the same text; the reward model on a shared batch) and runs
the scoring passes (actor, reference, critic, reward model) on shared batches, each process its
1/N of every sequence's positions, gathered into whole lines. Sums over processes count a
group's numbers once (stages/collectives.py sum_once_per_group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from core import batching
from core.rewards import RewardError, RuleReward, RunningMoments, Samples
from stages import collectives, data, losses, policy_losses, sequence_parallel, watchdog
from stages.advantages import AdvantageInputs, AdvantageSettings, estimate_advantages
from stages.generation import Sampled, generate
from stages.models import position_scores, sequence_scores
from stages.phases import Clock


@dataclass(frozen=True)
class Prompt:
    """One data row as a prompt to sample from."""

    split: str  # "train" or "eval": which rows `index` counts in
    index: int  # the row's position in its split (among the rows the stage keeps: see data.tokenized_splits)
    text: str
    ids: list[int]  # the prompt's token ids
    row: dict  # every column of the data row (reward functions see them all)
    label: str | None  # the label column (label_key), what exact_match compares with

    @property
    def name(self) -> str:
        return f"{self.split} row {self.index}"


@dataclass
class Models:
    """The four models of an RL stage: actor and critic are DeepSpeed engines that train; the
    reference and the reward model are frozen (stages/models.py FrozenModel). Any: DeepSpeed's and
    transformers' objects, which carry no types."""

    actor: Any
    reference: Any | None  # None without a KL term (kl_coef 0): not loaded, never run
    tokenizer: Any
    critic: Any | None = None  # gae only
    reward_model: Any | None = None
    reward_tokenizer: Any | None = None


@dataclass
class TrainBatch:
    """A micro batch of a rollout for one training pass: B sequences right-padded to their
    longest (W tokens); the per-token tensors are (B, W - 1), aligned with token_logprobs.
    Where processes share sequences `tokens` is this process's part (lines widened to a multiple
    of the processes: `whole` cuts what they give back)."""

    tokens: data.Batch
    mask: torch.Tensor  # response tokens that train
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None  # None without a reference
    advantages: torch.Tensor
    returns: torch.Tensor | None  # gae
    values: torch.Tensor | None  # gae: the critic's values at sampling time
    sampler_weights: torch.Tensor | None = None  # truncated importance weights (samples from vLLM)


@dataclass
class RolloutStats:
    """What a rollout says about itself (means and counts over every process)."""

    reward: float  # mean raw reward of every sample drawn, kept or dropped
    terms: dict  # each reward term's mean, the same samples
    response_tokens: float  # generated tokens, all processes
    tokens: float  # tokens of the rollout's sequences (prompt + response), all processes
    sequences: int  # sequences that train, all processes
    sampling: dict = field(default_factory=dict)  # dynamic sampling: groups_kept, groups_dropped, ...
    sampler: dict = field(default_factory=dict)  # vLLM: its log-probs against the trainer's (sampler_logprob_diff_*)


@dataclass
class Rollout:
    """One process's share of a rollout, ready to train on.

    S sequences: the samples of each prompt contiguous, the same S on every process.
    W is the longest prompt + response here; per-token tensors are (S, W - 1), on the device,
    entry t about the token at t + 1 (losses.token_logprobs' alignment), 0 past each sequence.
    """

    sequences: list[list[int]]  # S token id lists: prompt + response, cut to max_len
    response_masks: list[list[int]]  # S lists: 1 on the response tokens of each sequence
    mask: torch.Tensor  # (S, W-1) float: response tokens that train (0 on places dynamic sampling filled)
    old_logprobs: torch.Tensor  # (S, W-1) the actor's at sampling time (temperature applied)
    # Without a reference (no KL term) both are None: nothing to compare with, rather than zeros
    # that would read as "the policy has not moved".
    ref_logprobs: torch.Tensor | None  # (S, W-1) the reference's
    kl: torch.Tensor | None  # (S, W-1) KL estimate per response token (kl_estimator)
    scores: torch.Tensor  # (S,) reward of each sequence after normalisation and clipping
    advantages: torch.Tensor  # (S, W-1)
    returns: torch.Tensor | None  # (S, W-1) gae: the critic's targets
    values: torch.Tensor | None  # (S, W-1) gae: the critic's values at sampling time
    processed_tokens: int = 0  # tokens the scoring passes processed here, padding included
    stats: RolloutStats | None = None
    # Samples from another engine (vLLM): its log-prob of each token, aligned as old_logprobs (0 off
    # the mask), and the truncated importance weights of the policy loss (None: no correction).
    sampler_logprobs: torch.Tensor | None = None
    sampler_weights: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def real_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def train_batch(self, rows: Sequence[int], pad_id: int, device) -> TrainBatch:
        """The rows as a micro batch (this process's part of it when processes share sequences)."""
        tokens = padded(self.sequences, self.response_masks, rows, pad_id, device)
        index = torch.tensor(list(rows), device=self.mask.device)
        width = token_width(tokens)

        def take(tensor):
            return None if tensor is None else tensor[index, :width]

        return TrainBatch(tokens, take(self.mask), take(self.old_logprobs), take(self.ref_logprobs),
                          take(self.advantages), take(self.returns), take(self.values), take(self.sampler_weights))


def padded(sequences, response_masks, rows: Sequence[int], pad_id: int, device):
    """Rows of a rollout as a right-padded micro batch on the device: this process's part of it
    where processes share sequences (its tensors are still the whole lines, widened to a multiple
    of the processes: `whole` cuts what they give back to the rollout's width)."""
    batch = data.padded_batch([{"input_ids": sequences[i], "loss_mask": response_masks[i]} for i in rows], pad_id)
    return sequence_parallel.shard(batch.to(device))


# --------------------------------------------------------------------------- sampling


def informative_groups(rewards: Sequence[float], group_size: int) -> list[bool]:
    """For each group of group_size contiguous samples: do its rewards differ? A group whose
    samples all got the same reward has zero group-relative advantage: it teaches nothing."""
    return [len(set(rewards[g : g + group_size])) > 1 for g in range(0, len(rewards), group_size)]


def gathered_mean(values: Sequence[float]) -> float:
    """The mean of a number per sample over the rollout's samples (a sharing group holds its own once)."""
    total, count = collectives.sum_once_per_group([float(sum(values)), float(len(values))])
    return total / max(count, 1.0)


@dataclass
class _Drawn:
    """Samples drawn over the rounds of one rollout on this process."""

    prompts: list = field(default_factory=list)  # one Prompt per sample
    responses: list = field(default_factory=list)  # token ids
    rewards: list = field(default_factory=list)  # raw summed reward
    trains: list = field(default_factory=list)  # False on places filled with a dropped group
    terms: dict = field(default_factory=dict)  # reward term -> its value's mean, once per sample
    logprobs: list = field(default_factory=list)  # the sampler's token log-probs per sample (vLLM), or None

    def add(self, prompts, responses, rewards, trains: bool = True, terms: dict | None = None,
            logprobs: Sequence | None = None) -> None:
        self.prompts += list(prompts)
        self.responses += list(responses)
        self.logprobs += list(logprobs) if logprobs is not None else [None] * len(prompts)
        self.rewards += list(rewards)
        self.trains += [trains] * len(prompts)
        for name, mean in (terms or {}).items():
            self.terms.setdefault(name, []).extend([mean] * len(prompts))


class RolloutMaker:
    """Makes one rollout after another; holds the running reward statistics (checkpointed)."""

    def __init__(self, stage, ctx, models: Models, rules: RuleReward, generate_fn: Callable = generate,
                 clock: Clock | None = None):
        self.stage, self.ctx, self.models, self.rules = stage, ctx, models, rules
        self.generate_fn = generate_fn
        self.clock = clock if clock is not None else Clock()
        self.moments = RunningMoments()
        self.advantage_settings = AdvantageSettings(
            group_size=stage.n_samples_per_prompt, gamma=stage.gamma, lam=stage.lam, scale_rewards=stage.scale_rewards)

    def generate(self, prompts: Sequence[Prompt], greedy: bool = False) -> Sampled:
        """The engine's completions (transformers' engines give token ids alone: no log-probs of their own)."""
        out = self.generate_fn(self.models.actor, prompts, tokenizer=self.models.tokenizer, stage=self.stage,
                               device=self.ctx.device, greedy=greedy, clock=self.clock)
        return _as_sampled(out)

    def moved_s(self) -> float:
        """Seconds the offloaded frozen models have spent moving so far (stages/models.py FrozenModel)."""
        return sum(m.moved_s for m in (self.models.reference, self.models.reward_model) if m is not None)

    # ---- one rollout

    def make(self, prompts_of_round: Callable[[int], list[Prompt]], kl_coef: float) -> Rollout:
        """Sample (over rounds, with dynamic sampling), score and prepare this process's share.
        prompts_of_round(k) gives the prompts of sampling round k (round 0 = the rollout's own)."""
        clock = self.clock
        moved_before = self.moved_s()
        every, kept, sampling = self._draw(prompts_of_round)
        with clock.phase("score_s"):
            scores = self._normalized(kept.rewards, every.rewards)
            rollout = self._views(kept, scores, kl_coef)
            response_tokens, tokens, sequences = collectives.sum_once_per_group(  # one collective for the three counts
                [float(sum(len(r) for r in every.responses)), float(rollout.real_tokens), float(sum(kept.trains))])
        clock.add("offload_s", self.moved_s() - moved_before)  # part of score_s (stages/phases.py)
        rollout.stats = RolloutStats(
            reward=gathered_mean(every.rewards),
            terms={name: gathered_mean(values) for name, values in every.terms.items()},
            response_tokens=response_tokens, tokens=tokens, sequences=int(sequences), sampling=sampling,
            sampler=sampler_gap(rollout))
        return rollout

    def _draw(self, prompts_of_round):
        """Sample and score round after round until every process holds as many groups whose
        rewards differ as it has prompts (one round without dynamic sampling). Returns every
        sample drawn, the samples of the rollout and the dynamic sampling counts."""
        stage, n = self.stage, self.stage.n_samples_per_prompt
        every, kept, spare = _Drawn(), _Drawn(), _Drawn()
        uniform = 0
        for round_ in range(stage.dynamic_sampling_max_rounds if stage.dynamic_sampling else 1):
            batch = [p for p in prompts_of_round(round_) for _ in range(n)]
            wanted = len(batch)
            with self.clock.phase("generate_s"):
                sampled = self.sample(batch)
            responses = sampled.ids
            logprobs: Sequence[list[float] | None] = sampled.logprobs or [None] * len(batch)
            with self.clock.phase("score_s"):
                rewards, terms = self.score(batch, responses)
            every.add(batch, responses, rewards, terms=terms, logprobs=logprobs)
            if not stage.dynamic_sampling:
                return every, every, {}
            for g, informative in enumerate(informative_groups(rewards, n)):
                part = slice(g * n, (g + 1) * n)
                uniform += not informative
                target = kept if informative and len(kept.prompts) < wanted else spare
                target.add(batch[part], responses[part], rewards[part], logprobs=logprobs[part])
            if collectives.sum_once_per_group([float(wanted - len(kept.prompts))])[0] == 0:
                break
        missing = wanted - len(kept.prompts)  # places left: dropped groups fill them, and do not train
        kept.add(spare.prompts[:missing], spare.responses[:missing], spare.rewards[:missing], trains=False,
                 logprobs=spare.logprobs[:missing])
        counts = collectives.sum_once_per_group([float(sum(kept.trains) // n), float(uniform), float(missing // n)])
        sampling = {"groups_kept": counts[0], "groups_dropped": counts[1], "groups_filled": counts[2],
                    "sampling_rounds": round_ + 1}
        return every, kept, sampling

    @watchdog.phase(watchdog.GENERATION)
    def sample(self, prompts: Sequence[Prompt], greedy: bool = False) -> Sampled:
        """Completions of `prompts`. Where processes share sequences, every process of a group holds
        the same prompts: each samples its 1/N of them (contiguous, so a prompt's samples stay
        together; whole sequences, as without sharing) and the group gathers them in order (the
        engines that do that report no log-probs of their own: config refuses vllm there)."""
        layout = sequence_parallel.layout()
        if layout.size == 1:
            return _as_sampled(self.generate(prompts, greedy))
        part = len(prompts) // layout.size  # callers give a multiple of the group's processes
        mine = _as_sampled(self.generate(prompts[layout.rank * part : (layout.rank + 1) * part], greedy)).ids
        everyone: list = [None] * layout.size
        dist.all_gather_object(everyone, mine, group=layout.group)
        return Sampled([response for responses in everyone for response in responses])

    @watchdog.phase(watchdog.SCORING)
    def score(self, prompts: Sequence[Prompt], responses: list[list[int]]) -> tuple[list[float], dict[str, float]]:
        """Summed reward per completion, before normalisation, and each term's mean. A reward rule that
        fails on one process (or runs past reward.timeout_s: core/reward_process.py) stops every process
        with its message, after the same collective calls on each (the others would otherwise wait for
        it forever)."""
        tokenizer, stage = self.models.tokenizer, self.stage
        completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
        samples = Samples(prompts=[p.text for p in prompts], completions=completions, rows=[p.row for p in prompts],
                          labels=[p.label for p in prompts], lengths=[len(r) for r in responses],
                          names=[p.name for p in prompts])
        failure: RewardError | None = None
        total = [0.0] * len(responses)
        terms: dict[str, float] = {}
        # The functions bound their own calls; the others wait here for the slowest (the watchdog: as long).
        with watchdog.phase(watchdog.REWARD_FUNCTIONS, at_least_s=self.rules.longest_s):
            try:
                if self.rules.terms:
                    total, terms = self.rules(samples)
            except RewardError as err:
                failure = err
            everyone = [None] * self.ctx.world_size
            dist.all_gather_object(everyone, None if failure is None else failure.message)
        first = next((message for message in everyone if message is not None), None)
        if first is not None:  # every process says the same, the first failure's message
            raise failure if failure is not None and failure.message == first else RewardError(first)
        if self.models.reward_model is not None:
            scores = self._reward_model_scores(samples)
            total = [t + stage.reward.model_weight * s for t, s in zip(total, scores)]
            terms["reward_model"] = sum(scores) / max(len(scores), 1)
        return total, terms

    def _reward_model_scores(self, samples: Samples) -> list[float]:
        """Re-tokenised with the reward model's tokenizer, formatted as it was trained."""
        stage, tokenizer = self.stage, self.models.reward_tokenizer
        assert tokenizer is not None  # loaded with the reward model
        rows = []
        for text, completion in zip(samples.prompts, samples.completions):
            ids = (data.encode_prompt(tokenizer, text, stage.data)
                   + data.encode_response(tokenizer, text, completion, stage.data))[: stage.max_len]
            rows.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
        scores = [0.0] * len(rows)
        lengths = [len(row["input_ids"]) for row in rows]
        for part in batching.by_length(range(len(rows)), lengths, stage.micro_rollout_batch_size):
            batch = sequence_parallel.shard(data.padded_batch([rows[i] for i in part], tokenizer.pad_token_id)
                                            .to(self.ctx.device))
            read = sequence_scores(self.models.reward_model, batch, tokenizer.pad_token_id)
            for i, score in zip(part, read.tolist()):
                scores[i] = score
        return scores

    def _normalized(self, rewards: list[float], drawn: list[float]) -> list[float]:
        """reward.normalize: by the running moments of every reward drawn so far (all processes);
        reward.clip: clipped."""
        stage = self.stage
        if stage.reward.normalize:
            everyone: list = [None] * self.ctx.world_size
            dist.all_gather_object(everyone, drawn)
            # The processes of a sharing group (consecutive ranks) drew the same: one of each group.
            self.moments.update([r for part in everyone[:: sequence_parallel.layout().size] for r in part])
            return self.moments.normalize(rewards, stage.reward.clip)
        if stage.reward.clip:
            return [max(-stage.reward.clip, min(stage.reward.clip, r)) for r in rewards]
        return list(rewards)

    # ---- the frozen models' views and the advantages

    @torch.no_grad()
    def _views(self, drawn: _Drawn, scores: list[float], kl_coef: float) -> Rollout:
        stage, models, device = self.stage, self.models, self.ctx.device
        sequences = [(p.ids + r)[: stage.max_len] for p, r in zip(drawn.prompts, drawn.responses)]
        response_masks = [([0] * len(p.ids) + [1] * len(r))[: stage.max_len]
                          for p, r in zip(drawn.prompts, drawn.responses)]
        width = max(len(s) for s in sequences) - 1
        shape = (len(sequences), width)
        old = torch.zeros(shape, device=device)
        ref = torch.zeros(shape, device=device) if models.reference is not None else None
        values = torch.zeros(shape, device=device) if models.critic is not None else None
        mask = torch.zeros(shape, device=device)
        models.actor.eval()
        if models.critic is not None:
            models.critic.eval()
        processed = 0
        lengths = [len(s) for s in sequences]
        for rows in batching.by_length(range(len(sequences)), lengths, stage.micro_rollout_batch_size):
            batch = padded(sequences, response_masks, rows, models.tokenizer.pad_token_id, device)
            w = token_width(batch)
            processed += batch.processed_tokens
            part = torch.tensor(rows, device=device)
            old[part, :w] = logprobs_of(models.actor, batch, stage.temperature)[0]
            if ref is not None:
                ref[part, :w] = logprobs_of(models.reference, batch, stage.temperature)[0]
            mask[part, :w] = batch.loss_mask[:, 1 : w + 1].float()
            if values is not None:
                values[part, :w] = values_of(models.critic, batch)
        mask *= torch.tensor(drawn.trains, dtype=mask.dtype, device=device).unsqueeze(1)
        sampler = sampler_logprobs(drawn, sequences, shape, device)
        kl = policy_losses.kl_penalty(old, ref, stage.kl_estimator) * mask if ref is not None else None
        score_tensor = torch.tensor(scores, dtype=torch.float32, device=device)
        if values is not None:
            values *= mask
        # No reference means kl_coef 0: the estimators' KL term is 0 x 0.
        inputs = AdvantageInputs(scores=score_tensor, kl=kl if kl is not None else torch.zeros_like(mask),
                                 mask=mask, kl_coef=kl_coef if stage.kl_in_reward else 0.0, values=values)
        advantages, returns = estimate_advantages(stage.advantage, inputs, self.advantage_settings,
                                                  collectives.sum_once_per_group)
        weights = None
        if sampler is not None and stage.sampler_ratio_cap is not None:
            weights = policy_losses.sampler_correction(old, sampler, mask, stage.sampler_ratio_cap,
                                                       stage.importance_sampling)
        return Rollout(sequences, response_masks, mask, old, ref, kl, score_tensor, advantages, returns, values,
                       processed, sampler_logprobs=sampler, sampler_weights=weights)

    # ---- held-out reward

    @torch.no_grad()
    def held_out_reward(self, prompts: Sequence[Prompt]) -> float:
        """Mean reward of greedy completions of the held-out prompts (each scored once, over all
        data-parallel groups; a group's processes sample its prompts together: `sample`)."""
        layout = sequence_parallel.layout()
        share = list(prompts[layout.data_rank :: layout.data_world])
        calls = -(-len(prompts) // layout.data_world)  # the same number of prompts on every group,
        calls = -(-calls // layout.size) * layout.size  # split evenly over its processes
        filled = share + (share or list(prompts))[:1] * (calls - len(share))
        rewards, _ = self.score(filled, self.sample(filled, greedy=True).ids)
        return gathered_mean(rewards[: len(share)])


def _as_sampled(out) -> Sampled:
    """What `RolloutMaker.generate` gave, as Sampled (a test's stand-in may give token ids alone)."""
    return out if isinstance(out, Sampled) else Sampled(out)


def sampler_logprobs(drawn: _Drawn, sequences: list[list[int]], shape, device) -> torch.Tensor | None:
    """The sampler's log-prob of each response token (S, W-1), aligned as old_logprobs (entry t is
    about token t + 1; responses cut to max_len as their sequences are), or None where the samples
    came without them (a transformers engine, the same as the trainer's)."""
    if any(logprobs is None for logprobs in drawn.logprobs):
        return None
    out = torch.zeros(shape)
    for i, (prompt, logprobs) in enumerate(zip(drawn.prompts, drawn.logprobs)):
        kept = logprobs[: len(sequences[i]) - len(prompt.ids)]
        out[i, len(prompt.ids) - 1 : len(prompt.ids) - 1 + len(kept)] = torch.tensor(kept)
    return out.to(device)


def sampler_gap(rollout: Rollout) -> dict:
    """How far the sampler's log-probs are from the trainer's for the tokens that train, over every
    process: the mean and the largest absolute difference. Empty without a sampler of its own."""
    if rollout.sampler_logprobs is None:
        return {}
    gap = (rollout.old_logprobs - rollout.sampler_logprobs).abs() * rollout.mask
    total, count = collectives.sum_once_per_group([float(gap.sum()), float(rollout.mask.sum())])
    largest = collectives.largest_of_any_process(gap.max().detach().reshape(1).double())  # on gap's device
    return {"sampler_logprob_diff_mean": total / max(count, 1.0), "sampler_logprob_diff_max": float(largest)}


def token_width(batch: data.Batch) -> int:
    """W - 1, the per-token entries of a padded micro batch of sequences at most W long (a shared
    batch's lines are wider: widened to a multiple of its processes, stages/sequence_parallel.py)."""
    return max(batch.lengths) - 1


def whole(batch: data.Batch, per_token: torch.Tensor) -> torch.Tensor:
    """A (B, W'-1) per-token tensor of a padded micro batch cut to its sequences' width W - 1."""
    return per_token[:, : token_width(batch)]


def logprobs_of(model, batch: data.Batch, temperature: float):
    """Token log-probs (B, W-1) of the batch's response tokens under the model (sampling
    temperature applied; losses.token_logprobs' alignment), whole lines where processes share them,
    and the logits of the positions this process ran."""
    logits = batch.forward(model).logits
    return whole(batch, batch.logprobs(logits.float() / temperature)), logits


def entropy_of(batch: data.Batch, logits: torch.Tensor) -> torch.Tensor:
    """The policy's entropy (B, W-1) at each position that predicts a token, from its logits as
    they are (no temperature), whole lines where processes share them (each computes its own
    positions')."""
    return whole(batch, batch.gathered(losses.entropy_from_logits(logits.float()))[:, :-1])


def values_of(critic, batch: data.Batch) -> torch.Tensor:
    """The critic's value (B, W-1) at each position, aligned with token_logprobs (predicting token t+1)."""
    return whole(batch, position_scores(critic, batch)[:, :-1])
