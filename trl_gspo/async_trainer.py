"""GSPO in TRL 1.16's asynchronous trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`).

TRL's asynchronous trainer generates with a vLLM server while it trains: a rollout worker keeps the server busy, the
trainer streams its weights to the server after each optimizer step, and samples up to `max_staleness` weight versions
old are trained on with the sampler's log-probs as pi_old (never recomputed). Its loss is token-level only. This
subclass adds `loss_type="gspo"` / `"gspo_token"` (the GSPO paper's Eq. 5-7 / 13-14, arXiv 2507.18071) on TRL's packed
rows, where one row holds many completions told apart by `segment_id`:

    s_i = exp( (1/|y_i|) sum_t log pi_theta(y_i,t) / pi_old(y_i,t) )     over completion i's trained tokens only

so tool results and other context (TRL's `completion_mask` 0) never enter `|y_i|`. The objective is a plain mean over
the completions of a micro-batch (every rank's), as the synchronous `GSPOTrainer` takes it over its micro-batch. The
math is `trl_gspo.losses.gspo_packed_loss`; this module only wires it into TRL and logs the same `gspo/*` metrics as
`GSPOTrainer`, plus the share of completions whose ratio was clipped by sample age (weight versions behind when the
trainer read it): `gspo/clipped_sequence_fraction/age_K`. `loss_type="grpo"` is TRL's own loss, untouched.

Everything else is TRL's: the rollout worker, staleness dropping, packing, weight transfer, checkpoints and resume.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    _EmptyIterableDataset,
)
from trl.trainer.utils import pad

from . import metrics as gspo_metrics
from .config import GSPO_LOSS_TYPES, PAPER_EPSILON_HIGH, PAPER_EPSILON_LOW
from .losses import gspo_packed_loss, unpack_segments

# "grpo": TRL's asynchronous loss as it ships (token-level clipped ratio, mean over the micro-batch's tokens).
ASYNC_LOSS_TYPES = (*GSPO_LOSS_TYPES, "grpo")


@dataclass
class AsyncGSPOConfig(AsyncGRPOConfig):
    """`AsyncGRPOConfig` with GSPO's loss types. For `"gspo"` / `"gspo_token"`, fields left unset take the GSPO paper's
    values (Section 5.1): `epsilon=3e-4`, `epsilon_high=4e-4`. TRL's asynchronous trainer has no KL term and no
    reference model, so the paper's `beta=0` holds by construction. For `"grpo"` the defaults are TRL's (`0.2`)."""

    loss_type: str = field(
        default="gspo",
        metadata={"help": "'gspo' (sequence ratio, GSPO paper Eq. 5/7), 'gspo_token' (Eq. 13-14), or 'grpo' (TRL's "
                          "own asynchronous token-level loss)."},
    )
    epsilon: float | None = field(
        default=None,
        metadata={"help": "Lower clip range. Unset: 3e-4 for gspo types (GSPO paper), 0.2 for 'grpo' (TRL's)."},
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clip range. Unset: 4e-4 for gspo types (GSPO paper); for 'grpo', same as epsilon."},
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "gspo types: cap on the unclipped sequence ratio for negative advantages (two-sided / dual "
                          "clip, > 1 + epsilon_high): a stale sample the policy has made much more likely can no "
                          "longer push an unbounded negative update. None (default): the paper's objective."},
    )

    def __post_init__(self):
        if not isinstance(self.loss_type, str) or self.loss_type not in ASYNC_LOSS_TYPES:
            raise ValueError(f"`loss_type`: {self.loss_type!r} is not one AsyncGSPOTrainer runs. Fix: use one of "
                             f"{', '.join(repr(t) for t in ASYNC_LOSS_TYPES)} (TRL's asynchronous trainer implements "
                             "no other loss type).")
        for name in ("epsilon", "epsilon_high", "delta"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool)):
                raise ValueError(f"`{name}` must be a number, got {value!r}. Fix: e.g. `{name}=3e-4`.")
        is_gspo = self.loss_type in GSPO_LOSS_TYPES
        unset = [name for name in ("epsilon", "epsilon_high") if getattr(self, name) is None]
        if self.epsilon is None:
            self.epsilon = PAPER_EPSILON_LOW if is_gspo else 0.2
        if self.epsilon_high is None and is_gspo:
            self.epsilon_high = PAPER_EPSILON_HIGH
        self.paper_presets = {name: getattr(self, name) for name in unset} if is_gspo else {}
        high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        if not 0 < self.epsilon < 1 or high <= 0:
            raise ValueError(f"`epsilon` / `epsilon_high`: the clip band [1 - {self.epsilon}, 1 + {high}] is empty or "
                             "reaches 0. Fix: 0 < epsilon < 1 and epsilon_high > 0 (GSPO paper: 3e-4 / 4e-4).")
        if self.delta is not None:
            if not is_gspo:
                raise ValueError("`delta`: TRL's asynchronous 'grpo' loss has no two-sided clip. Fix: leave delta "
                                 "unset, or use loss_type='gspo'.")
            if self.delta <= 1 + high:
                raise ValueError(f"`delta` ({self.delta}) must exceed 1 + epsilon_high ({1 + high}). Fix: e.g. 1.5.")
        if self.max_staleness < 0:
            raise ValueError(f"`max_staleness` ({self.max_staleness}) must be >= 0. Fix: 0 trains on-policy samples "
                             "only; TRL's default is 4.")
        super().__post_init__()


class _RecordingQueue:
    """The rollout queue, remembering the last sample read from it (TRL's reader keeps only some of its fields)."""

    def __init__(self, queue):
        self._queue, self.last = queue, None

    def get(self, *args, **kwargs):
        self.last = self._queue.get(*args, **kwargs)
        return self.last

    def qsize(self):
        return self._queue.qsize()


class _VersionedRolloutQueueDataset(RolloutQueueDataset):
    """TRL's queue reader (stale samples dropped as TRL drops them: by their age when read), each kept sample with the
    weight version that sampled it, which TRL's reader leaves out."""

    def __init__(self, rollout_queue, **kwargs):
        super().__init__(_RecordingQueue(rollout_queue), **kwargs)

    def __iter__(self):
        for item in super().__iter__():
            item["model_version"] = self.queue.last.model_version
            yield item


@dataclass
class _VersionedRolloutCollator(DataCollatorForRollout):
    """TRL's packer, plus per row the weight version that sampled each completion (`segment_version`, by segment id,
    -1 padding) and the micro-batch's completion count over all rows (`global_n_sequences`, repeated per rank as
    TRL's counts are)."""

    def torch_call(self, examples):
        batch = super().torch_call(examples)
        (rows,) = examples
        batch["segment_version"] = pad([torch.tensor([s["model_version"] for s in row.samples]) for row in rows],
                                       padding_value=-1)
        batch["global_n_sequences"] = torch.full((self.num_processes,), float(sum(len(row.samples) for row in rows)))
        return batch


class AsyncGSPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` with `loss_type` "gspo" / "gspo_token" (`AsyncGSPOConfig`); same arguments as TRL's.

        trainer = AsyncGSPOTrainer(model="Qwen/Qwen3-30B-A3B", reward_funcs=accuracy_reward, train_dataset=dataset,
                                   args=AsyncGSPOConfig(output_dir="out", vllm_server_base_url="http://gen-node:8000"))
        trainer.train()
    """

    _tag_names = ["trl", "async-grpo", "gspo", "trl-gspo"]
    _name = "AsyncGSPO"

    def __init__(self, model, reward_funcs=None, args: AsyncGSPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = AsyncGSPOConfig(f"{str(model).split('/')[-1]}-AsyncGSPO")
        elif not isinstance(args, AsyncGSPOConfig):
            raise TypeError(f"`args` must be an AsyncGSPOConfig (got {type(args).__name__}). Fix: build it with "
                            "trl_gspo.AsyncGSPOConfig(...), which takes every AsyncGRPOConfig field.")
        self.loss_type = args.loss_type
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        """TRL's pipeline (queue reader -> planner -> packer) with the reader and packer that keep sample ages."""
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
        collator = _VersionedRolloutCollator(self.processing_class.pad_token_id, processes,
                                        groups_trained=self._trained_groups, metrics=self._metrics["train"],
                                        token_budget=max(self.args.token_budget or 0, 0))
        return self.accelerator.prepare(DataLoader(dataset, batch_size=1, collate_fn=collator, num_workers=0))

    def _sync_weight(self):
        """TRL's weight sync; then every rank learns the policy's weight version (TRL counts it on the main process
        only), to age the samples it trains on."""
        super()._sync_weight()
        self._policy_version = broadcast_object_list([self.model_version], from_process=0)[0]

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        for name in ("segment_version", "global_n_sequences"):
            if name not in self._signature_columns:
                self._signature_columns.append(name)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.loss_type not in GSPO_LOSS_TYPES:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise ValueError("AsyncGSPOTrainer.compute_loss does not return model outputs (TRL's does not either).")

        targets = inputs["token_index"] >= 0
        logps, entropies, aux_loss = self._packed_forward(model, inputs)
        segment_id = inputs["segment_id"][targets]
        versions = inputs["segment_version"][inputs["segment_version"] >= 0]
        # Age when trained, which can exceed the age TRL dropped by: the dataloader reads a batch ahead, before the
        # previous step's weight sync (measured: a batch read at version 1 trained at version 2).
        ages = self._policy_version - versions
        out = gspo_packed_loss(logps, inputs["old_log_probs"][targets], inputs["advantages"][targets], segment_id,
                               token_level=self.loss_type == "gspo_token", num_segments=ages.numel(),
                               eps_low=self.epsilon_low, eps_high=self.epsilon_high, delta=self.args.delta)
        # A plain mean over the micro-batch's completions on every rank: DDP/FSDP average gradients over ranks, so
        # each rank divides its sum by the global count over the world size (TRL's token loss does the same).
        world = self.accelerator.num_processes
        sequences_per_rank = (inputs["global_n_sequences"][0] / world).clamp(min=1.0)
        policy_loss = out.per_sequence_loss.sum() / sequences_per_rank
        loss = policy_loss / self.current_gradient_accumulation_steps
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps

        entropy_rows, mask = unpack_segments(segment_id, entropies.detach(), num_segments=ages.numel())
        self._log_gspo_metrics(out, mask, entropy_rows, policy_loss.detach(), ages,
                               aux_loss.detach() if self.aux_loss_enabled else None)
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

    def _log_gspo_metrics(self, out, mask, entropies, policy_loss, ages, aux_loss):
        """`GSPOTrainer`'s `gspo/*`, `clip_ratio/*`, `entropy`, `policy_loss` (trl_gspo/metrics.py), over every rank,
        and per sample age the clipped completions as a (clipped, count) rate: one reduce, one gather, one host read."""
        sums = gspo_metrics.metric_sums(out, mask, entropies, policy_loss, aux_loss=aux_loss,
                                        with_delta=self.args.delta is not None)
        buckets = self.args.max_staleness + 2  # read at most max_staleness old, then possibly one sync later
        clipped = (out.low_clipped | out.high_clipped).any(-1).float()
        age = ages.clamp(0, buckets - 1)
        by_age = torch.stack([torch.zeros(buckets, device=clipped.device).index_add_(0, age, clipped),
                              torch.bincount(age, minlength=buckets).float()])
        reduced = self.accelerator.reduce(torch.cat([torch.stack(list(sums.values())), by_age.flatten()]),
                                          reduction="sum")
        # Ranks hold different completion counts: NaN rows pad them to one shape for the gather, then go.
        rows = self.accelerator.pad_across_processes(gspo_metrics.per_sequence_values(out, mask), dim=0,
                                                     pad_index=float("nan"))
        rows = self.accelerator.gather(rows)
        rows = rows[~rows.isnan().any(-1)]
        values = gspo_metrics.finish(dict(zip(sums, reduced[:len(sums)])), rows)
        host = torch.cat([torch.stack(list(values.values())).float(), reduced[len(sums):]]).tolist()
        for name, value in zip(values, host):
            self._metrics["train"][name].append(value)
        clipped_by_age, count_by_age = host[len(values):len(values) + buckets], host[len(values) + buckets:]
        for k in range(buckets):
            if count_by_age[k]:
                self._metrics["train"][f"gspo/clipped_sequence_fraction/age_{k}"].append(
                    (clipped_by_age[k], count_by_age[k]))
