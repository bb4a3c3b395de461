"""LoRA in GSPOTrainer's rollouts and weight syncs: adapters folded into the weights without writing the frozen base
(`trl_gspo.lora_merge`).

- Weight syncs to vLLM (TRL's `VLLMGeneration._iter_named_params`): each adapted base tensor is sent as `W + delta`
  built out of place, one parameter at a time, instead of TRL's in-place `merge_adapter()` / `unmerge_adapter()`,
  whose bf16 rounding moves the base a little at every sync (`exact_lora_merge`).
- A rollout (`merge_adapters_for_rollout`): HF generate and TRL's old-policy pass run with the experts' adapters
  folded, `W + delta` built once per rollout instead of in every forward (decode steps included). They are the
  tensors the active forward builds, so generation and the old-policy pass are bit for bit what they are with the
  adapters active, and the on-policy ratio stays exactly 1. Only where the whole weight is on the device: a ZeRO-3
  model generating layer by layer (`ds3_gather_for_generation=False`), an FSDP model (v1 or v2) and ZeRO-3's
  old-policy pass keep PEFT's active path, and under ZeRO-3 the copy folded for generation is freed when generation
  ends. The copy's size is logged (`lora/folded_rollout_bytes`, once as a line, and in the run summary).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.utils import logging

from ..config import runs_old_policy_pass
from ..lora_merge import (LoraMergeError, adapter_targets, exact_sync_stream, merged_adapters, model_is_whole,
                          unmergeable_layers)
from .routing import _first_adapter_layer, _reference_pass

logger = logging.get_logger(__name__)


def exact_sync_model(trainer) -> torch.nn.Module | None:
    """The PEFT model whose weight syncs can send `W + delta` out of place (`exact_lora_merge`), or None: no LoRA,
    the option off, or a layout where TRL's stream copies the parameters (FSDP) or PEFT alone can fold a layer
    (a warning then says the base drifts)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not getattr(trainer.args, "exact_lora_merge", True) or not adapter_targets(model):
        return None
    reason = None
    if trainer.is_fsdp_enabled:
        reason = "under FSDP TRL sends copies of the sharded parameters, which cannot be matched to their adapters"
    elif unmergeable_layers(model):
        reason = f"{', '.join(unmergeable_layers(model))} layers are folded by PEFT only"
    if reason is not None:
        logger.warning(f"LoRA weight syncs use PEFT's in-place merge and unmerge ({reason}): in bf16 the frozen base "
                       "weights drift by rounding at every sync (docs/lora.md).")
        return None
    return model


def _zero3(trainer) -> bool:
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(trainer.is_deepspeed_enabled and getattr(plugin, "zero_stage", 0) == 3)


def _fsdp_version(trainer) -> int | None:
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", 1) if trainer.is_fsdp_enabled else None


def check_lora_layout(trainer, model) -> None:
    """Refuse, before any compute, a LoRA layout that cannot train: LoRA on fused expert parameters under FSDP v1,
    where PEFT reads the adapters' weights outside their modules' forward and finds flat shards (it fails at the first
    generation, adapters active or folded)."""
    if _fsdp_version(trainer) == 1 and any(target.expert_stack for target in adapter_targets(model)):
        raise ValueError(
            "LoRA on fused expert parameters (`target_parameters`) cannot run under FSDP v1: PEFT reads those "
            "adapters' weights outside their modules' forward, where FSDP v1 holds flat shards. Fix: `fsdp_version: 2` "
            "in the accelerate config, DeepSpeed ZeRO-3, or LoRA on `target_modules` only (docs/lora.md).")


def keep_factors_gathered(trainer) -> int:
    """Under DeepSpeed ZeRO-3, keep the LoRA factors of every PEFT `ParamWrapper` (LoRA on parameters,
    `target_parameters`: fused MoE experts) gathered from their first use in a forward until the optimizer step.
    Returns how many factors it marked now (0 once done, and outside ZeRO-3). Called at each training step, with or
    without a `TrainerLora`: idempotent, a walk of the modules.

    PEFT's `ParamWrapper` builds its weight in its forward by reading `lora_A[name].weight` and `lora_B[name].weight`
    directly (`get_delta_factors`, `get_delta_weight`); the factor modules' own forward never runs. DeepSpeed gathers a
    parameter read that way (`ZeROOrderedDict.__getitem__`) but does not mark it external, so it releases it at the
    wrapper's post-forward hook, and backward then finds an empty tensor ("The size of tensor a (0) must match the
    size of tensor b (16)"); plain TRL fails the same way. Factors under `stage3_param_persistence_threshold` are never
    released, so only real sizes can fail (Qwen3-30B-A3B's are 0.4-1M elements). The fix sets DeepSpeed's
    per-parameter flag `is_external_param = True` on each factor, which `release_sub_module` checks before releasing a
    parameter (DeepSpeed sets it itself for parameters a module returns). The optimizer step still partitions every
    parameter (`partition_all_parameters`), so a factor is held whole from its first forward of a step to the step.
    `deepspeed.initialize` resets the flag (`_convert_to_deepspeed_param`), hence a call per step, not at construction.
    """
    if not _zero3(trainer):
        return 0
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return 0
    marked = 0
    for module in trainer.accelerator.unwrap_model(trainer.model).modules():
        if not isinstance(module, ParamWrapper):
            continue
        for factors in (module.lora_A, module.lora_B):
            for factor in factors.values():
                for weight in factor.parameters(recurse=False):  # not `.weight`: no gather outside a forward
                    if hasattr(weight, "ds_id") and not getattr(weight, "is_external_param", False):
                        weight.is_external_param = True
                        marked += 1
    if marked and trainer.accelerator.is_main_process:
        logger.info(f"LoRA under ZeRO-3: {marked} factors of PEFT `target_parameters` layers kept gathered from their "
                    "first forward to the optimizer step (PEFT reads them outside their modules' forward).")
    return marked


class TrainerLora:
    """Folds a `GSPOTrainer`'s LoRA adapters for its rollouts and weight syncs; `build` returns None without LoRA."""

    # ZeRO-3 + `target_parameters`: not tied to `build`, which returns None without active adapters (see the function)
    keep_factors_gathered = staticmethod(keep_factors_gathered)

    FOLDED_BYTES = "lora/folded_rollout_bytes"  # the folded experts' copy a rollout held on this rank (0: none)

    def __init__(self, trainer, model):
        self.trainer, self.model = trainer, model
        self.cache: dict | None = None  # the experts' folded weights of the current rollout
        self.fold_rollout = getattr(trainer.args, "merge_adapters_for_rollout", True)
        # ZeRO-3 and FSDP hold shards outside generation: the old-policy pass cannot fold. Generation folds only
        # inside TRL's whole-model gather: ZeRO-3's own hooks would overwrite a folded weight when they fetch it
        # layer by layer (`ds3_gather_for_generation=False`), and FSDP generates unit by unit.
        self.keep_for_old_pass = not (_zero3(trainer) or trainer.is_fsdp_enabled)
        self.fold_generation = self.fold_rollout and not trainer.is_fsdp_enabled and not (
            _zero3(trainer) and not getattr(trainer.args, "ds3_gather_for_generation", True))
        self._adapter_layer = _first_adapter_layer(model)
        self._held = 0  # bytes of folded weights this rollout held at most
        self._announced = False

    @classmethod
    def build(cls, trainer) -> TrainerLora | None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        if not adapter_targets(model):
            return None
        check_lora_layout(trainer, model)
        lora = cls(trainer, model)
        off = lora._not_folding()
        if off is not None and trainer.accelerator.is_main_process:
            reason, unexplained = off  # a warning only where nothing in the run's settings says why
            (logger.warning if unexplained else logger.info)(
                f"LoRA: expert adapters are not folded for rollouts: {reason} (docs/lora.md).")
        if trainer.use_vllm:
            lora._install_exact_sync()
        return lora

    def _not_folding(self) -> tuple[str, bool] | None:
        """Why no rollout will fold the experts, and whether no setting of the run explains it (sharded weights
        outside FSDP and ZeRO-3); None when some rollout block will fold them."""
        trainer = self.trainer
        if not self.fold_rollout:
            return "`merge_adapters_for_rollout` is off", False
        if not adapter_targets(self.model, experts_only=True):
            return "no parameter is adapted directly (PEFT `target_parameters`: fused experts, a router)", False
        if trainer.use_vllm and (getattr(trainer, "_sampler_logps", None) is not None
                                 or not runs_old_policy_pass(trainer.args)):
            return "vLLM generates and no old-policy forward runs", False
        if trainer.is_fsdp_enabled:
            return "under FSDP each unit is gathered in its own forward and holds shards between forwards", False
        if _zero3(trainer) and (trainer.use_vllm or not self.fold_generation):
            generation = ("vLLM's" if trainer.use_vllm else
                          "gathered layer by layer (`ds3_gather_for_generation: false`)")
            return f"under ZeRO-3 the old-policy pass runs on shards and generation is {generation}", False
        if self.keep_for_old_pass and not model_is_whole(self.model):
            return "the weights are sharded (DTensor, ZeRO-3 or FSDP v1 parameters: `model_is_whole`)", True
        return None

    def _install_exact_sync(self) -> None:
        if exact_sync_model(self.trainer) is None:
            return
        generation = self.trainer.vllm_generation
        stream = generation._iter_named_params  # TRL's: gathers ZeRO-3 parameters, names them as vLLM expects
        accelerator = self.trainer.accelerator

        def sends() -> bool:
            # server mode walks the stream once for the tensors' metadata, and non-main ranks walk it only to join
            # the gathers: neither sends a tensor, so neither builds a W + delta
            if generation.mode != "server":
                return True
            return accelerator.is_main_process and generation._weight_metadata is not None

        # A consumer must receive every tensor it expects (a server's packed transfer waits for each announced one; a
        # colocated engine's tensor-parallel load is collective): a failure is kept, the stream completes (base
        # weights in place of a failed `W + delta`), and the sync raises it once the consumer has everything; every
        # rank raises it (GSPOTrainer's sync is `trl_gspo.ranks.together`).
        errors: list[BaseException] = []

        def exact_stream():
            build = sends()  # a walk that sends nothing (the metadata pass, non-main ranks) raises at once
            return exact_sync_stream(self.model, stream, build=build, errors=errors if build else None)

        generation._iter_named_params = exact_stream
        sync = generation.sync_weights
        where = "vLLM server" if generation.mode == "server" else "colocated vLLM engine"

        def sync_then_raise():
            errors.clear()
            sync()
            if errors:
                raise LoraMergeError(f"{errors[0]}. The transfer to the {where} was completed with the base weights "
                                     "in its place, so nothing waits on it; the run stops here.") from errors[0]

        generation.sync_weights = sync_then_raise

    def _note_held(self) -> None:
        self._held = max(self._held, sum(weight.nbytes for weight in self.cache.values()))

    @contextlib.contextmanager
    def rollout(self):
        """One rollout: generation and the old-policy pass share the experts' folded weights, freed at its end (or as
        soon as generation ends when the old-policy pass runs on shards and cannot use them)."""
        self.cache, self._held = {}, 0
        generate = vars(self.model).get("generate")
        if self.fold_generation and not self.trainer.use_vllm:
            original = self.model.generate

            def folded_generate(*args, **kwargs):
                if not model_is_whole(self.model):  # sharded while generating: each layer gathered in its forward
                    return original(*args, **kwargs)
                # the experts only: attention LoRA costs two thin matmuls, and folding it would change the samples'
                # log-probs by rounding; folding the experts changes nothing, bit for bit
                with merged_adapters(self.model, experts_only=True, cache=self.cache):
                    result = original(*args, **kwargs)
                self._note_held()
                if not self.keep_for_old_pass:  # ZeRO-3 / FSDP: gathered for generation only
                    self.cache.clear()
                return result

            self.model.generate = folded_generate  # TRL calls it inside its unwrap/gather context
        try:
            yield
        finally:
            if self.cache:
                self._note_held()
            self.cache = None
            if generate is None:
                vars(self.model).pop("generate", None)
            else:  # an instance `generate` someone set before: back in place, not wrapped once more per rollout
                self.model.generate = generate
            self._report_held()

    def _report_held(self) -> None:
        if not self.fold_rollout:
            return
        self.trainer._metrics["train" if self.trainer.model.training else "eval"][self.FOLDED_BYTES].append(
            float(self._held))
        if self._held and not self._announced and self.trainer.accelerator.is_main_process:
            self._announced = True
            span = ("from generation to the end of the old-policy pass" if self.keep_for_old_pass else
                    "during generation only (the old-policy pass runs on shards)")
            logger.info(f"LoRA: a rollout holds {self._held / 2**30:.3f} GiB of folded expert weights (W + delta) on "
                        f"each rank, {span}; `merge_adapters_for_rollout: false` saves it (docs/lora.md).")

    def old_policy_pass(self, model, grad_enabled: bool):
        """A context for one of TRL's log-prob passes: the experts folded for a no-grad pass of the policy within a
        rollout, else nothing."""
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        if (not self.fold_rollout or self.cache is None or grad_enabled or unwrapped is not self.model
                or not self.keep_for_old_pass or _reference_pass(self._adapter_layer) or not model_is_whole(self.model)):
            return contextlib.nullcontext()
        return merged_adapters(self.model, experts_only=True, cache=self.cache)

