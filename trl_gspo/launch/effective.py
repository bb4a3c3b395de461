"""What a run will do once accelerate's launcher has applied its settings: compute precision, processes, the
distributed layout (ZeRO stage and offload, FSDP), gradient accumulation and the batch sizes.

A recipe is not the whole story. `accelerate launch` exports its config's `mixed_precision` as
`ACCELERATE_MIXED_PRECISION`, and transformers' `TrainingArguments` trains with it whenever `bf16` and `fp16` are
both false: `bf16: false` under a `mixed_precision: bf16` launcher trains in bf16 autocast. `resolve` computes the
settings from the launch options (before launching: `trl-gspo`, `--dry_run`) or from the environment (inside a
launched process); `check_agreement` refuses a recipe its launcher contradicts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..config import PRECISIONS
from .recipe import RecipeError, launch_options

# The launcher shipped for full-precision recipes, by the launcher it replaces (the others: a copy with mixed_precision
# 'no').
FULL_PRECISION_CONFIGS = {"FSDP": "recipes/accelerate/fsdp2_fp32.yaml"}


@dataclass(frozen=True)
class Launcher:
    """The settings a launcher applies to every process it starts."""

    mixed_precision: str = "no"  # "no", "bf16", "fp16": ACCELERATE_MIXED_PRECISION
    distributed_type: str = "NO"  # DEEPSPEED, FSDP, MULTI_GPU, NO
    processes: int = 1
    machines: int = 1
    zero_stage: int | None = None
    offload: tuple[str, ...] = ()  # what lives in host memory: "parameters", "optimizer state"
    gradient_accumulation_steps: int | None = None  # a DeepSpeed launcher's own, when it sets one
    source: str = "no launcher"  # where these came from, for messages

    @classmethod
    def from_launch_args(cls, launch_args: list[str]) -> Launcher:
        """The settings `accelerate launch <launch_args>` applies: its options over its config file (accelerate's
        default config file when none is named, as accelerate reads it)."""
        options, config = launch_options(launch_args)
        source = options.config_file
        if not options.config_file and not options.cpu:
            from accelerate.commands.config import default_config_file

            if os.path.isfile(default_config_file):
                _, config = launch_options(launch_args + ["--config_file", default_config_file])
                source = default_config_file
        deepspeed = dict(config.get("deepspeed_config") or {})
        if deepspeed.get("deepspeed_config_file") and os.path.isfile(deepspeed["deepspeed_config_file"]):
            with open(deepspeed["deepspeed_config_file"]) as handle:
                zero = json.load(handle).get("zero_optimization", {})
            deepspeed.setdefault("zero_stage", zero.get("stage"))
            for key, name in (("offload_param_device", "offload_param"), ("offload_optimizer_device",
                                                                          "offload_optimizer")):
                deepspeed.setdefault(key, (zero.get(name) or {}).get("device", "none"))
        distributed = ("DEEPSPEED" if options.use_deepspeed else "FSDP" if options.use_fsdp
                       else str(config.get("distributed_type", "NO")).upper())
        fsdp = config.get("fsdp_config") or {}
        return cls(
            mixed_precision=str(options.mixed_precision or config.get("mixed_precision") or "no").lower(),
            distributed_type=distributed,
            processes=int(options.num_processes or config.get("num_processes") or 1),
            machines=int(options.num_machines or config.get("num_machines") or 1),
            zero_stage=_int(options.zero_stage or deepspeed.get("zero_stage")) if distributed == "DEEPSPEED" else None,
            offload=_offload(distributed, options.offload_param_device or deepspeed.get("offload_param_device"),
                             options.offload_optimizer_device or deepspeed.get("offload_optimizer_device"),
                             fsdp.get("fsdp_offload_params")),
            gradient_accumulation_steps=(_int(options.gradient_accumulation_steps
                                              or deepspeed.get("gradient_accumulation_steps"))
                                         if distributed == "DEEPSPEED" else None),
            source=f"accelerate config {source}" if source else "accelerate launch's options")

    @classmethod
    def from_environment(cls, environ=os.environ) -> Launcher:
        """The settings of the process this runs in, as `accelerate launch` exported them (defaults when the
        process was started some other way)."""
        deepspeed = environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        fsdp = environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        distributed = ("DEEPSPEED" if deepspeed else "FSDP" if fsdp
                       else "MULTI_GPU" if int(environ.get("WORLD_SIZE", "1")) > 1 else "NO")
        return cls(
            mixed_precision=environ.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
            distributed_type=distributed,
            processes=int(environ.get("WORLD_SIZE", "1")),
            machines=max(1, int(environ.get("WORLD_SIZE", "1")) // max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))),
            zero_stage=_int(environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")) if deepspeed else None,
            offload=_offload(distributed, environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
                             environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                             environ.get("FSDP_OFFLOAD_PARAMS")),
            gradient_accumulation_steps=(_int(environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"))
                                         if deepspeed else None),
            source="ACCELERATE_MIXED_PRECISION and the launcher's other variables" if environ.get(
                "ACCELERATE_MIXED_PRECISION") else "no launcher")


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):  # None, or DeepSpeed's "auto"
        return None


def _offload(distributed: str, param_device, optimizer_device, fsdp_params) -> tuple[str, ...]:
    if distributed == "DEEPSPEED":
        return tuple(name for name, device in (("parameters", param_device), ("optimizer state", optimizer_device))
                     if str(device or "none").lower() not in ("none", ""))
    if distributed == "FSDP" and str(fsdp_params).lower() == "true":
        return ("parameters", "optimizer state")
    return ()


@dataclass(frozen=True)
class EffectiveSettings:
    """A run's settings after the launcher: what it trains in and over how many processes."""

    precision: str  # "no", "bf16", "fp16": the autocast transformers applies
    precision_from_launcher: bool  # bf16 and fp16 false: the launcher's mixed_precision applies
    use_cpu: bool
    model_dtype: str | None
    launcher: Launcher
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    generation_batch_size: int | None

    @property
    def precision_from(self) -> str:
        """Why the run trains in `precision`: the recipe's bf16/fp16, or the launcher."""
        if not self.precision_from_launcher:
            return f"{self.precision}: true"
        return ("bf16 and fp16 false" if self.precision == "no" else
                f"mixed_precision {self.precision} from {self.launcher.source}, as bf16 and fp16 are false")

    @property
    def completions_per_optimizer_step(self) -> int:
        return self.per_device_train_batch_size * self.launcher.processes * self.gradient_accumulation_steps

    def lines(self) -> list[str]:
        """The settings in words, one per line, as the dry run prints them."""
        launcher = self.launcher
        layout = {"DEEPSPEED": f"DeepSpeed ZeRO-{launcher.zero_stage or '?'}", "FSDP": "FSDP",
                  "MULTI_GPU": "data parallel (DDP)", "NO": "one process, no launcher sharding"}.get(
                      launcher.distributed_type, launcher.distributed_type)
        if launcher.offload:
            layout += f", {' and '.join(launcher.offload)} offloaded to the host"
        device = " on the CPU (use_cpu)" if self.use_cpu else ""
        weights = f", weights loaded in {self.model_dtype}" if self.model_dtype else ""
        lines = [f"precision: {PRECISIONS.get(self.precision, self.precision)}{device} ({self.precision_from})"
                 f"{weights}",
                 f"processes: {launcher.processes} over {launcher.machines} machine(s); {layout}",
                 f"batch: {self.per_device_train_batch_size} per process x {launcher.processes} process(es) x "
                 f"{self.gradient_accumulation_steps} accumulation steps = {self.completions_per_optimizer_step} "
                 "completions per optimizer step"]
        if self.generation_batch_size:
            lines[-1] += f"; {self.generation_batch_size} completions per rollout batch"
        return lines


def resolve(training_args, model_args=None, launcher: Launcher | None = None) -> EffectiveSettings:
    """The settings `training_args` train with under `launcher` (by default, the one this process runs under), by
    transformers' rule: `fp16` or `bf16` when set, otherwise the launcher's mixed precision."""
    launcher = launcher or Launcher.from_environment()
    from_launcher = not (training_args.fp16 or training_args.bf16)
    precision = launcher.mixed_precision if from_launcher else "fp16" if training_args.fp16 else "bf16"
    # The weights' dtype: the recipe's `dtype` (ModelConfig's; AsyncGRPOConfig's own, float32 by default), or the
    # Python API's model_init_kwargs.
    dtype = (getattr(model_args, "dtype", None) or getattr(training_args, "dtype", None)
             or (getattr(training_args, "model_init_kwargs", None) or {}).get("dtype"))
    return EffectiveSettings(
        precision=precision, precision_from_launcher=from_launcher, use_cpu=bool(training_args.use_cpu),
        model_dtype=None if dtype in (None, "auto") else str(dtype).replace("torch.", ""), launcher=launcher,
        per_device_train_batch_size=training_args.per_device_train_batch_size,
        gradient_accumulation_steps=training_args.gradient_accumulation_steps,
        # TRL derives the rollout batch from the processes it runs in (one, before launching): from the launcher's
        generation_batch_size=(training_args.per_device_train_batch_size * launcher.processes * steps
                               if (steps := getattr(training_args, "steps_per_generation", None)) else None))


def check_agreement(settings: EffectiveSettings, recipe_name: str = "the recipe") -> None:
    """Refuse (`RecipeError`) settings the launcher overrides behind the recipe's back: full precision asked for
    (`bf16: false`, `fp16: false`) under a mixed-precision launcher, and a DeepSpeed launcher's own gradient
    accumulation that differs from the recipe's."""
    launcher = settings.launcher
    if settings.precision != "no" and settings.precision_from_launcher:
        replacement = FULL_PRECISION_CONFIGS.get(launcher.distributed_type)
        fix = (f"launch with {replacement} (mixed_precision 'no')" if replacement else
               "launch with a copy of that config that sets mixed_precision: 'no'")
        dtype = f" and dtype {settings.model_dtype}" if settings.model_dtype else ""
        raise RecipeError(
            f"`accelerate_config`: {recipe_name} sets bf16: false{dtype} (full precision), and its launcher ("
            f"{launcher.source}) sets mixed_precision {launcher.mixed_precision}, which transformers applies whenever "
            f"bf16 and fp16 are false: the run would train in {launcher.mixed_precision} autocast. Fix: {fix}; or "
            f"set {launcher.mixed_precision}: true if mixed precision is what you want.")
    ours, theirs = settings.gradient_accumulation_steps, launcher.gradient_accumulation_steps
    if theirs is not None and theirs != ours:
        raise RecipeError(
            f"`gradient_accumulation_steps`: {recipe_name} sets {ours}, and its launcher ({launcher.source}) sets "
            f"{theirs}. Fix: remove gradient_accumulation_steps from the launcher's deepspeed_config (the recipe's "
            "then applies), or set both alike.")
