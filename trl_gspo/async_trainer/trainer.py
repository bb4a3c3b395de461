"""GSPO in TRL 1.16's asynchronous trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`).

TRL's asynchronous trainer generates with a vLLM server while it trains: a rollout worker keeps the server busy, the
trainer streams its weights to the server after each optimizer step, and samples up to `max_staleness + 1` weight
versions old (its loader fetches one micro-batch ahead of a sync) are trained on with the sampler's log-probs as
pi_old (never recomputed). Its loss is token-level only. This subclass adds `loss_type="gspo"` / `"gspo_token"`
(the GSPO paper's Eq. 5-7 / 13-14, arXiv 2507.18071), and TRL's successors "luspo", "sapo", "cispo", "vespo" as
`GRPOTrainer` computes them (`trl_gspo.losses.packed_policy_loss`, normalised by `step_loss`), on TRL's packed rows,
where one row holds many completions told apart by `segment_id`:

    s_i = exp( (1/|y_i|) sum_t log pi_theta(y_i,t) / pi_old(y_i,t) )     over completion i's trained tokens only

so tool results and other context (TRL's `completion_mask` 0) never enter `|y_i|`. The objective is a plain mean over
the completions of an optimizer step (every rank's, every micro-batch's), whatever TRL's token-budget packer put in
each micro-batch. With `staleness_correction`, the decoupled objective (`trl_gspo.losses.decoupled_gspo_loss`): the
band against the trainer's own weights, the sampler's distance as a capped sequence weight. The math is
`trl_gspo.losses.gspo_packed_loss`; this module only wires it into TRL and logs the same `gspo/*` metrics as
`GSPOTrainer`, plus the share of completions whose ratio was clipped by sample age (weight versions behind the
policy when trained): `gspo/clipped_sequence_fraction/age_K`. `loss_type="grpo"` is TRL's own loss, untouched.

`routing_replay="sampler"` (R3) forces, in the training forward, the experts each token used where the server
sampled it (trl_gspo/async_trainer/routing.py).

Everything else is TRL's: the rollout worker, staleness dropping, packing, weight transfer, checkpoints and resume.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader
from transformers.utils import logging
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    AsyncRolloutWorker,
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    _EmptyIterableDataset,
)
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import pad

from .. import metrics as gspo_metrics
from ..config import GSPO_LOSS_TYPES, band_description, default_output_dir, launch_summary
from ..lora_merge import exact_sync_stream, merge_calls_skipped
from ..losses import LOSS_REDUCTIONS, nonfinite_counts, packed_policy_loss, step_loss, unpack_segments
from ..ranks.phases import SYNC, RanksStopTogether, kept_failures, named_server_failures, rank_wait_timeout
from ..ranks.watch import phase
from ..ranks import FailedElsewhere
from ..routing.replay import RoutingReplay
from ..trainer.clip_band import AdaptiveClipBand, ClipBandStep, band_columns, band_stats, group_rewards_differ
from ..trainer.lora import exact_sync_model
from ..trainer.model_checks import check_model_source, hub_options
from .config import SEQUENCE_BAND_LOSS_TYPES, SOFT_LOSS_TYPES, AsyncGSPOConfig
from .routing import RoutedRolloutLoop, packed_routes

logger = logging.get_logger(__name__)


# The count each logged mean is taken over (the rest are extremes, spreads or per-rank gauges); `policy_loss`'s is
# the loss's own (`LOSS_REDUCTIONS`: over completions, or over tokens for cispo / vespo).
_RATE_COUNTS = {"clip_ratio/low_mean": "completions", "clip_ratio/high_mean": "completions",
                "clip_ratio/region_mean": "completions", "gspo/ratio_mean": "nonempty",
                "entropy": "tokens", "gspo/clipped_token_fraction": "tokens",
                "gspo/delta_clipped_token_fraction": "tokens"}
# What a loss without a hard clip (sapo, vespo) does not log: nothing is ever clipped.
_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                 "clip_ratio/region_mean", "gspo/clipped_token_fraction")


# Whether a sample's group's rewards differ (what the adaptive band reads), a key of the sample's `metrics`: set by
# TRL's rollout loop (`GroupRewardsLoop`), or by a custom rollout worker; the queue reader takes it out before TRL's
# packer averages the metrics for the logs.
GROUP_REWARDS_DIFFER = "trl_gspo/group_rewards_differ"


class GroupRewardsLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (the rollout worker's child process), marking each scored sample with whether its group's
    rewards differ (max > min over the group's scored rewards, TRL's `metrics["reward"]`): the advantage cannot say,
    as TRL's normalisation of a group of equal rewards leaves rounding, not always 0."""

    async def _score_group(self, group):
        samples = await super()._score_group(group)
        if samples:
            rewards = torch.tensor([sample.metrics["reward"] for sample in samples], dtype=torch.float64)
            for sample, differ in zip(samples, group_rewards_differ(rewards, len(samples)).tolist()):
                sample.metrics[GROUP_REWARDS_DIFFER] = differ
        return samples


class _RoutedGroupRewardsLoop(GroupRewardsLoop, RoutedRolloutLoop):
    """R3's rollout loop (routing.py), its samples marked as `GroupRewardsLoop` marks them."""


class _RecordingQueue:
    """The rollout queue, remembering the last sample read from it (TRL's reader keeps only some of its fields)."""

    def __init__(self, queue):
        self._queue, self.last = queue, None

    def get(self, *args, **kwargs):
        self.last = self._queue.get(*args, **kwargs)
        return self.last

    def qsize(self):
        return self._queue.qsize()


class _PackedGroups:
    """Where TRL's packer reports the prompt groups of each micro-batch it packs (TRL: the trainer's set of trained
    groups), kept in order until the micro-batch is trained. The data loader packs one micro-batch ahead of training,
    and a checkpoint saves as its prompt position the first group not in that set: counted when packed, a resumed
    run never trains the micro-batch packed ahead (measured: tests/test_async_vllm.py)."""

    def __init__(self):
        self.pending = deque()

    def update(self, groups):
        self.pending.append(set(groups))


class _VersionedRolloutQueueDataset(RolloutQueueDataset):
    """TRL's queue reader (stale samples dropped as TRL drops them: by their age when read), each kept sample with the
    weight version that sampled it, which TRL's reader leaves out."""

    def __init__(self, rollout_queue, **kwargs):
        super().__init__(_RecordingQueue(rollout_queue), **kwargs)

    def __iter__(self):
        for item in super().__iter__():
            item["model_version"] = self.queue.last.model_version
            item["routes"] = getattr(self.queue.last, "routes", None)  # RoutedRolloutSample (routing.py)
            item["rewards_differ"] = (item.get("metrics") or {}).pop(GROUP_REWARDS_DIFFER, None)
            yield item


@dataclass
class _VersionedRolloutCollator(DataCollatorForRollout):
    """TRL's packer, plus per row the weight version that sampled each completion (`segment_version`, by segment id,
    -1 padding), whether its group's rewards differ (`segment_rewards_differ`, 1 or 0, -1 padding; a sample that
    does not say, from a custom rollout worker: whether its advantage is not 0) and the micro-batch's completion count
    over all rows (`global_n_sequences`, repeated per rank as TRL's counts are)."""

    route_shape: tuple[int, int] | None = None  # (MoE layers, top_k) with routing_replay="sampler"
    route_dtype: torch.dtype = torch.uint8

    def torch_call(self, examples):
        batch = super().torch_call(examples)
        (rows,) = examples
        if self.route_shape is not None:  # the sampler's routes in the packed order, padded as the rows are
            laid_out = [packed_routes(row, [s["routes"] for s in row.samples], *self.route_shape, self.route_dtype)
                        for row in rows]
            batch["routes"] = pad([routes for routes, _ in laid_out], padding_value=0)
            batch["routed"] = pad([routed for _, routed in laid_out], padding_value=False)
        batch["segment_version"] = pad([torch.tensor([s["model_version"] for s in row.samples]) for row in rows],
                                       padding_value=-1)
        batch["segment_rewards_differ"] = pad([torch.tensor([int(s["advantage"] != 0 if s.get("rewards_differ") is None
                                                                  else s["rewards_differ"]) for s in row.samples])
                                                for row in rows], padding_value=-1)
        batch["global_n_sequences"] = torch.full((self.num_processes,), float(sum(len(row.samples) for row in rows)))
        return batch


def async_setup_summary(args) -> str:
    """What an `AsyncGSPOConfig` resolves to, in one line: the loss, its clip band, what pi_old is, the staleness bound,
    and the values the config filled in for fields left unset."""
    objective = ("pi_old is the sampler's log-probs" if args.staleness_correction == "none" else
                 f"the decoupled objective (staleness_correction={args.staleness_correction!r})")
    if args.loss_type in GSPO_LOSS_TYPES:
        loss = f"{band_description(args)}; {objective}"
    elif args.loss_type == "luspo":
        loss = f"GSPO's sequence term times the completion's length, {band_description(args)}; {objective}"
    elif args.loss_type == "cispo":
        loss = (f"each token's importance weight capped at epsilon_high={args.epsilon_high:g} and detached, times "
                f"its log-prob; a mean over the step's tokens; {objective}")
    elif args.loss_type == "sapo":
        loss = (f"no hard clip: each token's ratio r through the soft gate (4/tau) sigmoid(tau (r - 1)), tau="
                f"{args.sapo_temperature_pos:g} for A > 0, {args.sapo_temperature_neg:g} otherwise; a mean over "
                f"each completion's tokens, then over completions; {objective}")
    elif args.loss_type == "vespo":
        loss = (f"no hard clip: each completion's log-prob weighted by TRL's Gamma weight of its sequence ratio (k, "
                f"lambda = {args.vespo_k_pos:g}, {args.vespo_lambda_pos:g} for A >= 0; {args.vespo_k_neg:g}, "
                f"{args.vespo_lambda_neg:g} otherwise); a mean over the step's tokens; {objective}")
    else:
        high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        loss = f"TRL's token-level loss, epsilon={args.epsilon:g}, epsilon_high={high:g}"
    text = (f"AsyncGSPOTrainer, loss_type={args.loss_type!r}: {loss}; samples up to max_staleness={args.max_staleness} "
            "+ 1 weight versions old.")
    if args.presets:
        text += " AsyncGSPOConfig filled in for fields left unset: " + ", ".join(
            f"{name}={value!r}" for name, value in args.presets.items()) + "."
    return text


class AsyncGSPOTrainer(RanksStopTogether, AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` with `loss_type` "gspo" / "gspo_token" (`AsyncGSPOConfig`); same arguments as TRL's.

        trainer = AsyncGSPOTrainer(model="Qwen/Qwen3-30B-A3B", reward_funcs=accuracy_reward, train_dataset=dataset,
                                   args=AsyncGSPOConfig(output_dir="out", vllm_server_base_url="http://gen-node:8000"))
        trainer.train()
    """

    _tag_names = ["trl", "async-grpo", "gspo", "trl-gspo"]
    _name = "AsyncGSPO"

    def __init__(self, model, reward_funcs=None, args: AsyncGSPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = AsyncGSPOConfig(default_output_dir(model, "AsyncGSPO"))
        elif not isinstance(args, AsyncGSPOConfig):
            raise TypeError(f"`args` must be an AsyncGSPOConfig (got {type(args).__name__}). Fix: build it with "
                            "trl_gspo.AsyncGSPOConfig(...), which takes every AsyncGRPOConfig field.")
        if isinstance(model, str):  # a `builtin:` name, or a model neither local, nor cached, nor reachable: one line
            check_model_source(model, **hub_options(args.model_init_kwargs))
        self.loss_type = args.loss_type
        self._packed_groups = _PackedGroups()
        self._policy_version = 0  # the weight version the policy holds, on every rank (`_sync_weight`)
        self._step_completions = None  # the optimizer step's completions over every rank (`get_batch_samples`)
        self._step_tokens = None  # and its trained tokens (the loss tokens of cispo / vespo)
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._exact_lora = exact_sync_model(self)  # LoRA synced as W + delta out of place (trainer/lora.py), or None
        self._adaptive_band = (AdaptiveClipBand.build(args, self.epsilon_low, self.epsilon_high)
                               if self.loss_type in SEQUENCE_BAND_LOSS_TYPES else None)  # clip_band="adaptive", or None
        # The optimizer step at which the server last received these weights: until the next step, a sample of the
        # policy's own version was sampled by these weights, and its ratio measures the sampler's noise (clip_band.py).
        self._synced_at_step = None
        if self._adaptive_band is not None:
            self.add_callback(ClipBandStep(self))
        if self.accelerator.is_main_process:  # the band it trains with; a warning when presets changed TRL's
            (logger.warning if args.presets else logger.info)(async_setup_summary(args))
            logger.info(launch_summary(args, self.accelerator))
        self._routing = None
        if args.routing_replay == "sampler":
            self._routing = RoutingReplay(self.accelerator.unwrap_model(self.model))  # refuses a dense model
        loop_needed = self._routing is not None or self._adaptive_band is not None
        if loop_needed and isinstance(self.rollout_worker, AsyncRolloutWorker):  # TRL's own worker: its loop marks
            # whether each sample's group's rewards differ (the adaptive band reads it), and keeps R3's routes
            self.rollout_worker._loop_cls = GroupRewardsLoop if self._routing is None else _RoutedGroupRewardsLoop

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        if self._adaptive_band is not None and self.args.should_save:  # the same band on every rank
            self._adaptive_band.save(output_dir)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if self._adaptive_band is not None and checkpoint is not None:  # the band the run had, or one line naming it
            self.epsilon_low, self.epsilon_high = self._adaptive_band.resume(checkpoint, self.accelerator.is_main_process)

    def get_train_dataloader(self) -> DataLoader:
        """TRL's pipeline (queue reader -> planner -> packer) with a reader and a packer that keep each sample's weight
        version (and R3's routes)."""
        processes = self.accelerator.num_processes
        if self.accelerator.is_main_process:
            reader = _VersionedRolloutQueueDataset(
                self.rollout_queue, model_version_fn=lambda: self.model_version,
                check_health_fn=self.rollout_worker.check_health, stale_after_s=self.args.heartbeat_stale_after_s,
                metrics=self._metrics["train"], max_staleness=self.args.max_staleness, report_to=self.args.report_to)
            self._rollout_dataset = reader  # TRL flushes its queue-wait time at each optimizer step
            if self.args.token_budget is None:  # TRL's default: the server's max_model_len
                self.vllm_client.wait_for_server_ready()
                self.args.token_budget = self.vllm_client.get_max_model_len()
            if self.args.token_budget > 0:
                dataset = TokenBudgetBatcher(reader, processes, self.args.token_budget, self._metrics["train"])
            else:
                dataset = FixedCountBatcher(reader, processes, self.args.per_device_train_batch_size * processes)
        else:
            dataset = _EmptyIterableDataset()
        route_shape = (len(self._routing.routers), self._routing.top_k) if self._routing is not None else None
        collator = _VersionedRolloutCollator(self.processing_class.pad_token_id, processes,
                                             groups_trained=self._packed_groups, metrics=self._metrics["train"],
                                             token_budget=max(self.args.token_budget or 0, 0), route_shape=route_shape,
                                             route_dtype=self._routing.index_dtype if self._routing else torch.uint8)
        return self.accelerator.prepare(DataLoader(dataset, batch_size=1, collate_fn=collator, num_workers=0))

    def _sync_weight(self):
        """TRL's weight sync as an agreed section (trl_gspo/ranks/phases.py); then every rank learns the policy's weight
        version (TRL counts it on the main process only), to age the samples it trains on. On the main process a
        failed pause, transfer or resume (or LoRA adapter load) is kept while TRL's sync completes: its barriers and
        the stream's gathers are where the other ranks wait, so nothing later is sent to the server and the rest of
        the stream is walked. The version broadcast that follows carries the kept error instead (`FailedElsewhere`):
        every rank raises it, with no collective added."""
        failures: list[BaseException] = []
        main = self.accelerator.is_main_process
        client = getattr(self, "vllm_client", None) if main else None
        with phase(SYNC, rank_wait_timeout(self.args)), contextlib.ExitStack() as kept:
            transfer = self.weight_transfer if main else None
            calls = [(transfer, ("pause", "send_weights", "resume"))] if transfer is not None else []
            if client is not None and self._lora_sync:  # the LoRA sync talks to the server through TRL's client
                calls.append((client, ("pause", "load_lora_adapter", "unload_lora_adapter", "resume")))
            for target, names in calls:
                if client is not None:  # a connection error named as the server's
                    kept.enter_context(named_server_failures(target, names, client, self.args.output_dir))
                kept.enter_context(kept_failures(target, names, failures, drains=("send_weights",)))
            self._errors_of_exact_lora = failures if main else None
            try:
                super()._sync_weight()
            finally:
                self._errors_of_exact_lora = None
            version = [FailedElsewhere(failures[0], 0) if failures else self.model_version]
            version = broadcast_object_list(version, from_process=0)[0]
            if failures:
                raise failures[0]
            if isinstance(version, FailedElsewhere):
                version.raise_here()
        self._policy_version = version
        self._synced_at_step = self.state.global_step

    def _sync_weight_merged(self, t0):
        """TRL's merged weight sync. With LoRA (`exact_lora_merge`) TRL's in-place merge and unmerge are skipped and
        each adapted base tensor is streamed as `W + delta` built out of place: the frozen base stays bit for bit."""
        if self._exact_lora is None:
            return super()._sync_weight_merged(t0)
        with merge_calls_skipped(self._exact_lora):
            return super()._sync_weight_merged(t0)

    def _streaming_iter(self):
        if self._exact_lora is None:
            yield from super()._streaming_iter()
        else:
            # the main process keeps a failed W + delta and sends the base weight in its place (`_sync_weight` raises it)
            errors = getattr(self, "_errors_of_exact_lora", None)
            yield from exact_sync_stream(self._exact_lora, super()._streaming_iter, build=errors is not None,
                                         errors=errors)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Transformers' trainer fetches every micro-batch of an optimizer step before it trains the first. The packer
        gives each its completion (and TRL's its trained-token) count over all ranks, so their sums are the step's
        counts, on every rank, before any forward: sums of device scalars, no communication, no host read."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        for attribute, key in (("_step_completions", "global_n_sequences"), ("_step_tokens", "global_n_tokens")):
            counts = [batch[key][0] for batch in batch_samples if key in batch]
            setattr(self, attribute, sum(counts) if len(counts) == len(batch_samples) and counts else None)
        return batch_samples, num_items_in_batch

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        for name in ("segment_version", "segment_rewards_differ", "global_n_sequences", "routes", "routed"):
            if name not in self._signature_columns:
                self._signature_columns.append(name)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step; with routing_replay="sampler" inside one replay block (forward and backward: gradient
        checkpointing re-runs the routers in backward), forcing the sampler's routes at this rank's real positions.
        The micro-batch's prompt groups count as trained from here (`_PackedGroups`)."""
        if self._packed_groups.pending:  # main process: it packs
            self._trained_groups.update(self._packed_groups.pending.popleft())
        if self._routing is None:
            return super().training_step(model, inputs, num_items_in_batch)
        real = inputs["attention_mask"].bool()
        routed = inputs["routed"][real][None]
        if not bool(routed.any()):
            raise ValueError("routing_replay='sampler': no sample of this micro-batch came with the server's routes. "
                             "Fix: start the server with `trl-gspo vllm-serve` (it returns vLLM's routed experts for a "
                             "Mixture-of-Experts model), or set routing_replay='none'.")
        with self._routing.replay(inputs["routes"][real][None], routed, stats_mask=routed):
            loss = super().training_step(model, inputs, num_items_in_batch)
        counts = self.accelerator.reduce(torch.cat([self._routing.token_counts.sum(0).double(),
                                                    torch.stack([routed.sum(), real.sum()]).double()]),
                                         reduction="sum").tolist()
        drifted, overridden, counted, routed_tokens, tokens = counts
        self._metrics["train"]["routing/replay_drift"].append((drifted, counted))
        self._metrics["train"]["routing/replay_overridden_fraction"].append((overridden, counted))
        self._metrics["train"]["routing/unrouted_token_fraction"].append((tokens - routed_tokens, tokens))
        return loss

    def _loss_options(self) -> dict:
        """The options `packed_policy_loss` takes for this loss type, from the band in use and the config."""
        args = self.args
        if self.loss_type in SEQUENCE_BAND_LOSS_TYPES:
            return {"eps_low": self.epsilon_low, "eps_high": self.epsilon_high, "delta": args.delta}
        if self.loss_type == "cispo":
            return {"eps_high": self.epsilon_high}
        if self.loss_type == "sapo":
            return {"temperature_pos": args.sapo_temperature_pos, "temperature_neg": args.sapo_temperature_neg}
        return {"gamma_weights": GRPOTrainer.get_gamma_weights, "k_pos": args.vespo_k_pos,
                "lambda_pos": args.vespo_lambda_pos, "k_neg": args.vespo_k_neg, "lambda_neg": args.vespo_lambda_neg}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of `loss_type` on this rank's packed row (`packed_policy_loss`) as this micro-batch's share of the
        optimizer step's objective (`step_loss`): TRL's `GRPOTrainer` normalisation taken over the whole step (every
        rank, every micro-batch), a plain mean over its completions (gspo types, luspo, sapo) or over its trained
        tokens (cispo, vespo: TRL's `num_items_in_batch`), whatever the packer put in each micro-batch. DDP/FSDP
        average gradients over ranks, so each rank's share is multiplied by the world size. "grpo": TRL's own."""
        if self.loss_type not in LOSS_REDUCTIONS:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise ValueError("AsyncGSPOTrainer.compute_loss does not return model outputs (TRL's does not either).")

        targets = inputs["token_index"] >= 0
        logps, entropies, aux_loss = self._packed_forward(model, inputs)
        segment_id = inputs["segment_id"][targets]
        behaviour, advantages = inputs["old_log_probs"][targets], inputs["advantages"][targets]
        versions = inputs["segment_version"][inputs["segment_version"] >= 0]
        # Age when trained, which can exceed the age TRL dropped by: the dataloader reads a batch ahead, before the
        # previous step's weight sync (measured: a batch read at version 1 trained at version 2).
        ages = self._policy_version - versions
        # Checked with the metrics, after their one reduce over ranks, so a NaN on one rank stops every rank at once.
        nonfinite = nonfinite_counts(logps.detach(), behaviour, advantages, torch.ones_like(targets[targets]))
        decoupled = {}
        if self.args.staleness_correction != "none":  # proximal policy: these weights (each sample trains once)
            decoupled = dict(proximal_logps=logps.detach(), weight_cap=self.args.staleness_weight_cap,
                             weight_mode=self.args.staleness_correction)
        out = packed_policy_loss(self.loss_type, logps, behaviour, advantages, segment_id, num_segments=ages.numel(),
                                 check_inputs=False, **self._loss_options(), **decoupled)
        # Driven by hand (no `get_batch_samples`): the step taken as accumulation-steps micro-batches like this one.
        world = self.accelerator.num_processes
        micro = inputs["global_n_sequences"][0], inputs["global_n_tokens"][0]
        step = [count if count is not None else micro[k] * self.current_gradient_accumulation_steps
                for k, count in enumerate((self._step_completions, self._step_tokens))]
        loss = step_loss(out, *step) * world
        policy_loss = step_loss(out, *micro).detach() * world  # logged per micro-batch
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps

        entropy_rows, mask = unpack_segments(segment_id, entropies.detach(), num_segments=ages.numel())
        columns = None
        if self._adaptive_band is not None:  # clip_band="adaptive": its per-sequence signal (trainer/clip_band.py)
            on_sampling_weights = (ages == 0) & (self._synced_at_step == self.state.global_step)
            advantage_rows = unpack_segments(segment_id, advantages.float(), num_segments=ages.numel())[0]
            differ = inputs["segment_rewards_differ"]
            columns = band_columns(out, mask, advantage_rows, on_sampling_weights, differ[differ >= 0] > 0)
        self._log_gspo_metrics(out, mask, entropy_rows, policy_loss, ages,
                               aux_loss.detach() if self.aux_loss_enabled else None, nonfinite, columns)
        if self._adaptive_band is not None:  # the band this micro-batch trained with; it moves at the step's end
            for name, value in self._adaptive_band.in_use().items():
                self._metrics["train"][name].append(value)
        self._count_step_tokens(inputs)
        return loss

    def _packed_forward(self, model, inputs):
        """One forward of this rank's packed row (TRL's inter-rank padding stripped, tree attention over its trie):
        the log-prob and entropy of each trained target, in packed target order, and the router auxiliary loss."""
        real = inputs["attention_mask"].bool()
        targets = inputs["token_index"] >= 0
        tree = {key: inputs[key][inputs[key] >= 0]  # -1: TRL's padding
                for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
        tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
        started = time.time()
        outputs = model(input_ids=inputs["input_ids"][real][None], position_ids=inputs["position_ids"][real][None],
                        shift_labels=inputs["shift_labels"][real][None], fused_lm_head=True,
                        **({"output_router_logits": True} if self.aux_loss_enabled else {}), **tree)
        self._last_forward_time_s = time.time() - started
        index = inputs["token_index"][targets]
        return (outputs.log_probs.flatten()[index], outputs.entropy.flatten()[index],
                outputs.aux_loss if self.aux_loss_enabled else None)

    def _count_step_tokens(self, inputs):
        """TRL's per-optimizer-step accounting (its `perf/*` and `batch/*` metrics), from the counts the packer sent."""
        forwarded, mean_length = float(inputs["global_n_forward_tokens"][0]), float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += forwarded
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += mean_length * forwarded
        self._step_samples += forwarded / mean_length
        self._step_forward_s += self._last_forward_time_s

    def _log_gspo_metrics(self, out, mask, entropies, policy_loss, ages, aux_loss, nonfinite, band_columns=None):
        """`GSPOTrainer`'s `gspo/*`, `clip_ratio/*`, `entropy`, `policy_loss` (trl_gspo/metrics.py), over every rank,
        and per sample age the clipped completions as a (clipped, count) rate; with the decoupled objective, the
        sequence weights (mean, max, capped fraction) overall and per age. A loss without a hard clip (sapo, vespo)
        logs no clip metric; vespo logs TRL's `vespo/phi_seq_mean`, its Gamma weight's mean over completions. One
        reduce, one gather, one host read; the NaN/Inf counts ride in the reduce, so every rank raises together."""
        buckets = self.args.max_staleness + 2  # read at most max_staleness old, then possibly one sync later
        clipped = (out.low_clipped | out.high_clipped).any(-1).float()
        age = ages.clamp(0, buckets - 1)
        by_age = torch.stack([torch.zeros(buckets, device=clipped.device).index_add_(0, age, clipped),
                              torch.bincount(age, minlength=buckets).float()]).flatten()
        if out.gamma_weight is not None:  # vespo: [phi sum, completions] after the age buckets
            phi = out.gamma_weight.float()
            by_age = torch.cat([by_age, torch.stack([phi.sum(), torch.ones_like(phi).sum()])])
        weighted = out.behaviour_weight is not None
        columns = []
        if weighted:  # per-sequence columns 5-8 of the gathered rows
            columns.append(torch.stack([age.float(), out.behaviour_weight.float(), out.weight_capped.float(),
                                        out.behaviour_log_weight.float().abs()], 1))
        if band_columns is not None:  # the adaptive band's, after them; its statistics come last in `row_stats`
            columns.append(band_columns)
        band_first = gspo_metrics.PER_SEQUENCE_COLUMNS + 4 * weighted

        def row_stats(rows, present):
            stats = [self._weight_stats(rows, present, buckets)] if weighted else []
            if band_columns is not None:
                stats.append(band_stats(rows, present, band_first))
            return torch.cat(stats)

        read = gspo_metrics.read_to_host(
            self.accelerator, out, mask, entropies, policy_loss, nonfinite, aux_loss=aux_loss,
            with_delta=self.args.delta is not None, extra_sums=by_age,
            extra_columns=torch.cat(columns, 1) if columns else None, ranks_differ=True,
            row_stats=row_stats if columns else None)
        counts = {"tokens": read.tokens, "completions": read.completions, "nonempty": read.nonempty}
        rate_counts = {**_RATE_COUNTS, "policy_loss": "tokens" if out.reduction == "token" else "completions"}
        hard_clip = self.loss_type not in SOFT_LOSS_TYPES
        # Means over completions or tokens go to TRL's logger as (sum, count) rates: over a logging window of unequal
        # micro-batches each completion (token) then counts once, as in the loss.
        for name, value in read.values.items():
            if name in _CLIP_METRICS and not hard_clip:
                continue
            count = counts.get(rate_counts.get(name))
            self._metrics["train"][name].append(value if count is None else (value * count, count))
        clipped_by_age, count_by_age = read.extra_sums[:buckets], read.extra_sums[buckets:2 * buckets]
        if out.gamma_weight is not None:
            self._metrics["train"]["vespo/phi_seq_mean"].append(tuple(read.extra_sums[2 * buckets:]))
        for k in range(buckets if hard_clip else 0):
            if count_by_age[k]:
                self._metrics["train"][f"gspo/clipped_sequence_fraction/age_{k}"].append(
                    (clipped_by_age[k], count_by_age[k]))
        if weighted:
            self._log_weight_stats(read.row_stats, buckets)
        if band_columns is not None:  # after the weights' 4 per age bucket and overall, and their largest |log w_i|
            self._adaptive_band.observe(read.row_stats[(4 * (buckets + 1) + 1) * weighted:])
        return read

    @staticmethod
    def _weight_stats(rows, present, buckets):
        """Per age bucket and over all (last): count, weight sum, weight max, capped count; then the largest |log w_i|.
        From the gathered rows (columns 5-8: age, applied weight, capped, |log w_i|), on the device."""
        age, weight, capped, log_weight = rows[:, 5], rows[:, 6], rows[:, 7], rows[:, 8]
        stats = []
        for k in [*range(buckets), None]:
            selected = present if k is None else present & (age == k)
            stats += [selected.sum().float(), torch.where(selected, weight, 0).sum(),
                      torch.where(selected, weight, -torch.inf).max(), torch.where(selected, capped, 0).sum()]
        return torch.stack([*stats, torch.where(present, log_weight, 0).max()])

    def _log_weight_stats(self, stats, buckets):
        """`gspo/behaviour_weight/{mean,max,capped_fraction}` over the micro-batch, and `..._age_K` per sample age:
        the weight applied (after truncation; 0 where masked) and the share of completions the cap truncated or
        masked; and `gspo/behaviour_log_weight_abs_max`, the largest |log w_i| (the sampler-to-trainer gap, before
        the cap). ("max" in the name's last part: TRL's logger reads a window's reduction from it.)"""
        for k in [*range(buckets), None]:
            count, total, largest, capped = stats[:4]
            stats = stats[4:]
            if not count:
                continue
            suffix = "" if k is None else f"_age_{k}"
            self._metrics["train"][f"gspo/behaviour_weight/mean{suffix}"].append((total, count))
            self._metrics["train"][f"gspo/behaviour_weight/max{suffix}"].append(largest)
            self._metrics["train"][f"gspo/behaviour_weight/capped_fraction{suffix}"].append((capped, count))
        self._metrics["train"]["gspo/behaviour_log_weight_abs_max"].append(stats[0])
