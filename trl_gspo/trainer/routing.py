"""MoE routing inside the trainer: which pass records, what each pass replays, and the routing metrics.

`GSPOTrainer` calls one `TrainerRouting` at these points of a training step and nothing else of routing:

    generation (TRL)       `sampling()` around HF `generate`/vLLM    R3: records the sampler's routes (and log-probs)
    end of TRL's rollout   `end_sampling(prompts, completions, ..)`  R3: one route per token, stitched across turns
    policy passes          `policy_pass(call, ids, mask, width)`     R2: records; R3: replays the sampler's routes
    end of the round       `finish_round(output)`                    puts the routes to replay into the batch dict
    training micro-batch   `replay_for(inputs, attention_mask)`      the replay (or drift-only) context, or None
    after backward         `drift_counts()`, `keep_drift_counts(c)`  per-layer counts, reduced over ranks by the caller
    TRL's log              `take_metrics()`                          the `routing/*` values, one host read per log

Modes (`routing_replay`): "none" (natural routing; drift against the old-policy pass is still measured), "old"
(R2: the routes of TRL's old-policy pass, the GSPO paper's GRPO baseline) and "sampler" (R3: the routes each token
took where it was sampled, replayed in the old-policy pass and every training pass). Knows TRL's batch keys, not
TRL itself; the routing itself is `trl_gspo.routing`.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.utils import logging

from ..routing import RoutingReplay, RoutingReplayError, drift_statistics, find_routers, route_changes
from ..routing.rollout import (SampledRoutes, check_sampled_routes, has_route, pad_routes_like, record_generation,
                              route_dtype, wrapping_method)
from ..routing.stitching import SamplerCall, stitch_turns
from ..sampling.routes import routes_from_rollout_func

logger = logging.get_logger(__name__)

ROUTING_KEY = "routing_indices"  # batch-first: TRL's shuffle and split keep it aligned with its samples
ROLLOUT_ROUTES_KEY = "routed_experts"  # a rollout_func's routes, per sample (vLLM's name and layout)


class TrainerRouting:
    """Routing state of one trainer. Build it with `TrainerRouting.build`, which returns None for dense models."""

    def __init__(self, replay: RoutingReplay, mode: str, old_pass_runs: bool, temperature: float):
        self.replay = replay
        self.mode = mode
        self.old_pass_runs = old_pass_runs
        self.temperature = temperature
        self._recordings = None  # (logps, indices) of each policy pass in the current generation round (R2)
        self._sampling = False  # inside a training generation round with R3
        self._calls: list[SamplerCall] = []  # the current round's sampler calls (one per turn of a tool loop)
        self._stitched: SampledRoutes | None = None  # the round's routes, one entry per sample (end_sampling)
        self._sampler_routes = None  # padded sampler routes of the current round (R3)
        self._round_counts = None  # R3: sampler routes vs the old-policy pass's natural routes, per layer
        self._round_changed = None  # R3: [B, completion] tokens whose scoring position the sampler routed otherwise
        # R3 records the natural routes of the old-policy pass too (a second set of hooks, installed before the
        # replay's, so it sees the router's own choice): which tokens the sampler routed differently.
        self._natural = RoutingReplay(replay.model) if mode == "sampler" else None
        self._kept_counts: list[torch.Tensor] = []  # rank-summed drift counts of each micro-batch since the last log
        self._adapter_layer = _first_adapter_layer(replay.model)  # PEFT: tells TRL's reference pass from the others

    @classmethod
    def build(cls, model, args, old_pass_runs: bool) -> TrainerRouting | None:
        """Routing for `model` (unwrapped, PEFT base model). None when there is nothing to measure; raises
        `ValueError` when replay was asked for and cannot work. A tool loop's sampler routes are stitched across
        turns (`end_sampling`) in every layout: where TRL would slice a turn's results over processes, the turns run
        in lockstep (`trl_gspo.trainer.tool_lockstep`)."""
        mode = getattr(args, "routing_replay", "none")
        if not find_routers(model):
            if mode != "none":
                raise ValueError(f"`routing_replay`: {type(model).__name__} has no MoE router to replay. Fix: set "
                                 "routing_replay='none' (it only applies to Mixture-of-Experts models).")
            return None
        try:
            replay = RoutingReplay(model, offload_to_cpu=getattr(args, "routing_replay_offload", False))
        except RoutingReplayError as err:
            if mode != "none":
                raise ValueError(f"`routing_replay`: {err}") from None
            return None  # drift measurement is optional; replay was not asked for
        if mode == "old" and not old_pass_runs:
            logger.warning_once("routing_replay='old' with fully on-policy training: TRL runs no "
                                "old-policy pass, so there is nothing to record and replay changes nothing. Set "
                                "steps_per_generation > gradient_accumulation_steps or num_iterations > 1.")
        return cls(replay, mode, old_pass_runs, args.temperature)

    @property
    def routers(self):
        return self.replay.routers

    # ------------------------------------------------------------------ generation round
    @contextlib.contextmanager
    def round(self, training: bool):
        """A generation round (`_generate_and_score_completions`). R2 records every policy pass of it."""
        self._recordings = [] if (training and self.old_pass_runs and self.mode != "sampler") else None
        self._calls, self._stitched, self._sampler_routes = [], None, None
        self._round_counts, self._round_changed = None, None
        self._sampling = training and self.mode == "sampler"
        try:
            yield
        finally:
            self._recordings, self._sampling = None, False

    @contextlib.contextmanager
    def sampling(self, target, vllm: bool = False):
        """Around TRL's generation call (R3). `target()` gives what generates: the unwrapped model (HF `generate`:
        the experts of every token and the sampler's log-probs are recorded here), or, with `vllm=True`, a context
        manager over TRL's vLLM call (`trl_gspo.sampling.routes.capture_routes`: colocate at any TP size, or server).
        Yields `finish(prompt_ids, completion_ids, logprobs)` (this call's token lists, TRL's), which keeps the call's
        routes of this rank's completions and returns the sampler log-probs TRL should see, one list per completion."""
        if not self._sampling:
            yield None
            return
        if vllm:
            with target() as take:
                def finish_vllm(prompt_ids, completion_ids, logprobs):
                    dtype = route_dtype(self.replay.num_experts, self.replay.top_k)
                    self._keep(prompt_ids, completion_ids, take([len(ids) for ids in completion_ids], dtype), "vLLM")
                    return logprobs  # TRL's own, from vLLM

                yield finish_vllm
            return
        captured = {}

        def capturing(original):
            def generate(*args, **kwargs):  # keeps generate's own output and the prompt mask it was given
                output = original(*args, **kwargs)
                captured["sequences"] = output if torch.is_tensor(output) else output.sequences
                captured["prompt_mask"] = kwargs["attention_mask"]
                return output
            return generate

        with wrapping_method(target(), "generate", capturing):
            with record_generation(self.replay, self.temperature) as recording:
                def finish(prompt_ids, completion_ids, logprobs):
                    if not completion_ids:  # an empty tool turn (trainer/tool_lockstep.py): nothing of this rank's
                        return []
                    if "sequences" not in captured:
                        raise RuntimeError("routing_replay='sampler': TRL generated without calling the model's "
                                           "`generate`, so no sampler routes were recorded. Fix: use HF generation "
                                           "(not continuous batching) or vLLM, or set routing_replay='old'.")
                    sampled = recording.per_sample(captured["sequences"], captured["prompt_mask"],
                                                   [len(ids) for ids in completion_ids])
                    self._keep(prompt_ids, completion_ids, sampled, "HF generate")
                    return [logps.tolist() for logps in sampled.sampler_logps]

                yield finish

    def _keep(self, prompt_ids, completion_ids, sampled: SampledRoutes, source: str) -> None:
        """Validate one generate call's routes (before anything replays them) and keep them for the round."""
        if not completion_ids:  # an empty tool turn of this rank (trl_gspo.trainer.tool_lockstep): no call to stitch
            return
        check_sampled_routes(sampled, self.replay.num_experts, self.replay.top_k, source)
        self._calls.append(SamplerCall([list(ids) for ids in prompt_ids], [list(ids) for ids in completion_ids],
                                       sampled))

    def end_sampling(self, prompt_ids, completion_ids, extra_fields: dict) -> None:
        """After TRL's rollout (`_generate`): one route per token of each sample's final `prompt | completion`
        (TRL's unpadded token lists), stitched across the turns of a tool loop (`trl_gspo.routing.stitching`), or read
        from a rollout_func's `routed_experts` (taken out of `extra_fields`, so reward functions never see them)."""
        rollout_routes = extra_fields.pop(ROLLOUT_ROUTES_KEY, None)
        if rollout_routes is not None and self.mode != "sampler":
            logger.warning_once(f"the rollout_func returned {ROLLOUT_ROUTES_KEY!r}, which only "
                                f"routing_replay='sampler' replays; with routing_replay={self.mode!r} they are "
                                "dropped. Fix: set routing_replay='sampler' to replay them, or stop returning them.")
        if not self._sampling:
            return
        dtype = route_dtype(self.replay.num_experts, self.replay.top_k)
        if rollout_routes is not None:
            self._stitched = routes_from_rollout_func(rollout_routes, prompt_ids, completion_ids, dtype)
            check_sampled_routes(self._stitched, self.replay.num_experts, self.replay.top_k, "rollout_func")
        elif self._calls:
            self._stitched = stitch_turns(self._calls, prompt_ids, completion_ids)
        else:  # a rollout_func without routes: nothing to replay, and natural routing would be a silent guess
            raise ValueError(
                "`routing_replay`: 'sampler' with a rollout_func needs the routes your sampler used: return them "
                f"under {ROLLOUT_ROUTES_KEY!r}, one integer array per sample of shape [len(prompt_ids) + "
                "len(completion_ids) - 1, num_moe_layers, top_k] (vLLM's `routed_experts` layout; "
                "docs/sampling.md). Fix: return them, or set routing_replay='old'.")

    def _layout(self, prompt_width: int, completion_width: int, attention_mask=None) -> torch.Tensor:
        """The round's sampler routes laid out like TRL's padded `[prompt | completion]` batch."""
        if self._sampler_routes is not None:
            return self._sampler_routes
        if self._stitched is None:
            raise RuntimeError("routing_replay='sampler': this generation round recorded no sampler routes. Fix: "
                               "generate with HF generate or vLLM through GSPOTrainer, or set routing_replay='old'.")
        prompts, completions = self._stitched.prompt_routes, self._stitched.completion_routes
        positions = torch.arange(max(prompt_width, completion_width))
        prompt_mask = positions[:prompt_width] >= prompt_width - torch.tensor([len(r) for r in prompts])[:, None]
        completion_mask = positions[:completion_width] < torch.tensor([len(r) for r in completions])[:, None]
        if attention_mask is not None:  # TRL's own mask must agree where it marks real tokens
            real = attention_mask.bool().cpu()
            if not torch.equal(real[:, :prompt_width], prompt_mask) or bool(
                    (real[:, prompt_width:] & ~completion_mask).any()):
                raise RuntimeError("routing_replay='sampler': the sampler's routes do not line up with TRL's padded "
                                   "batch (prompt or completion lengths differ), so they would be replayed on the "
                                   "wrong tokens. Fix: report this with your TRL version; set routing_replay='old'.")
        self._sampler_routes = pad_routes_like(prompts, completions, prompt_mask, completion_mask)
        return self._sampler_routes

    def policy_pass(self, call, input_ids, attention_mask, logits_to_keep):
        """One scoring pass of the policy model during the generation round (TRL's old-policy pass, or another)."""
        if self._sampling:  # R3: the old-policy pass scores the experts that produced the tokens
            if _reference_pass(self._adapter_layer):
                return call()  # the reference policy routes naturally, as a separate reference model does
            prompt_width = input_ids.shape[1] - logits_to_keep
            routes = self._layout(prompt_width, logits_to_keep, attention_mask)
            force = has_route(routes) & attention_mask.bool().cpu()
            with self._natural.record() as natural, self.replay.replay(routes, mask=force, stats_mask=force):
                result = call()
            if self._round_counts is None:  # the round's first policy pass: TRL's old-policy pass
                self._round_counts = self.replay.token_counts
                # completion token t is scored by position prompt_width - 1 + t: its route decides its log-prob
                changed = route_changes(natural.indices.cpu(), routes) & force
                self._round_changed = changed[:, prompt_width - 1:-1]
            return result
        if self._recordings is None:
            return call()
        with self.replay.record() as recording:
            result = call()
        self._recordings.append((result[0], recording.indices))
        return result

    def finish_round(self, output: dict) -> dict:
        """Put the routes the training passes replay into the batch dict (`routing_indices`)."""
        if self._sampling:  # checked against TRL's masks here too: with old_logps="sampler" no policy pass ran
            attention_mask = (torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
                              if "prompt_mask" in output and "completion_mask" in output else None)
            output[ROUTING_KEY] = self._layout(output["prompt_ids"].shape[1], output["completion_ids"].shape[1],
                                               attention_mask)
            return output
        recordings = self._recordings
        if recordings is None:
            return output
        # The old-policy pass is the one whose log-probs TRL stored as `old_per_token_logps` (the same tensor
        # object): identified positively, whatever the order of TRL's passes (docs/trl_contract.md).
        old_logps = output.get("old_per_token_logps")
        matches = [indices for logps, indices in recordings if logps is old_logps]
        if len(matches) == 1:
            output[ROUTING_KEY] = matches[0]
        elif self.mode == "old":
            raise RuntimeError(
                f"routing_replay='old': none of the {len(recordings)} policy-model log-prob passes of this generation "
                "round produced the `old_per_token_logps` TRL stored, so the old-policy routing cannot be identified "
                "(this TRL version computes or stores them differently; see docs/trl_contract.md). Fix: use the TRL "
                "version tests/test_trl_contract.py passes with, or set routing_replay='none'."
            )
        return output

    def sampler_comparison(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """R3, the last round's old-policy pass against the sampler: `[layers, 3]` (differing, forced, counted)
        (token, layer) route counts, and `[B, completion]` route-changed tokens; (None, None) without that pass."""
        return self._round_counts, self._round_changed

    # ------------------------------------------------------------------ training micro-batch
    def replay_for(self, inputs: dict, attention_mask: torch.Tensor):
        """The replay (or drift-only measurement) context for a training micro-batch, or None."""
        indices = inputs.get(ROUTING_KEY)
        if indices is None:
            if self.mode == "sampler" or (self.mode == "old" and self.old_pass_runs):
                source = "sampling" if self.mode == "sampler" else "TRL's old-policy pass"
                raise RuntimeError(
                    f"routing_replay={self.mode!r}: this training micro-batch holds no routing recorded in {source}, "
                    "so it would silently train on natural routing. Cause: its rollout batch was built without routing replay "
                    f"(e.g. resumed from a checkpoint saved with another routing_replay), or by code that bypasses "
                    "GSPOTrainer._generate_and_score_completions. Fix: resume from a checkpoint saved with "
                    f"routing_replay={self.mode!r} (or start from a rollout boundary), or set routing_replay='none'."
                )
            return None
        if tuple(indices.shape[:2]) != tuple(attention_mask.shape):
            raise RuntimeError(
                f"routing_replay: the micro-batch's routing recording covers {tuple(indices.shape[:2])} (batch, "
                f"tokens) but its inputs are {tuple(attention_mask.shape)}, so the recorded experts cannot be matched "
                "to its tokens. Cause: the batch was padded, truncated or re-split after the old-policy pass. Fix: "
                "keep `routing_indices` split with the batch it was recorded on, or set routing_replay='none'."
            )
        if self.mode == "sampler":  # slots the sampler never routed (last token, padding) keep natural routing
            force = has_route(indices.cpu()).to(attention_mask.device) & attention_mask.bool()
            return self.replay.replay(indices, mask=force, stats_mask=force)
        force = None if self.mode == "old" else torch.zeros_like(attention_mask, dtype=torch.bool)
        return self.replay.replay(indices, mask=force, stats_mask=attention_mask)

    def drift_counts(self) -> torch.Tensor:
        """`[layers, 3]` (drifted, overridden, counted) token counts of the last replay, on the device; add over ranks
        first."""
        return self.replay.token_counts

    def keep_drift_counts(self, counts: torch.Tensor) -> None:
        """Keep a micro-batch's rank-summed counts on the device until TRL logs, so that a training step does not
        wait for its backward to finish just to read them."""
        self._kept_counts.append(counts)

    def take_metrics(self) -> list[tuple[str, float]]:
        """`(name, value)` of the `routing/*` metrics of each micro-batch kept since the last call, in order (TRL
        averages each name's values over the logging window); one host read for all of them."""
        kept, self._kept_counts = self._kept_counts, []
        if not kept:
            return []
        counts = torch.stack([c.to(kept[0].device) for c in kept]).cpu()
        return [item for micro_batch in counts for item in routing_metrics(micro_batch, self.mode).items()]


def _first_adapter_layer(model: torch.nn.Module):
    """A PEFT adapter layer of `model` (LoRA injects them into the base model's modules), or None."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    return next((module for module in model.modules() if isinstance(module, BaseTunerLayer)), None)


def _reference_pass(adapter_layer) -> bool:
    """Is TRL's PEFT reference pass running: the policy model with its adapters disabled, or with the adapter TRL
    loads as "ref" when it re-trains an existing adapter (TRL's `use_adapter`)."""
    return adapter_layer is not None and (bool(adapter_layer.disable_adapters)
                                          or list(adapter_layer.active_adapters) == ["ref"])


def routing_metrics(counts: torch.Tensor, mode: str) -> dict[str, float]:
    """The `routing/*` metrics from `[layers, 3]` counts summed over ranks (docs/metrics.md)."""
    drift, overridden_fraction = drift_statistics(counts.cpu())
    metrics = {"routing/drift_mean": drift.mean().item(), "routing/drift_max": drift.max().item()}
    if mode != "none":
        metrics["routing/replayed_token_fraction"] = overridden_fraction
    return metrics

