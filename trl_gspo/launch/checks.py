"""Checks of a parsed recipe, before anything is launched and in each launched process: `RecipeError`s that name
the key and the fix (values, the dataset, built-in model and task pairs, tools, the launcher, the dataset size).

`recipe.py` reads a recipe into dataclasses; this module judges what it read. Used by the command
(`trl_gspo.launch.cli`) and the launched entry point (`trl_gspo.launch.train`); imports neither, and no trainer.
"""

from __future__ import annotations

import math
import os

from ..config import did_you_mean
from ..trainer.model_checks import ModelSourceError, check_model_source, hub_options, hub_unreachable_once
from .recipe import (BUILTIN_DATASETS, BUILTIN_MODELS, BUILTIN_PREFIX, BUILTIN_TASK_MODELS, COLD_START_LAUNCHERS,
                     CONVERSATIONAL_BUILTIN_DATASETS, RecipeError, _check_builtin_dataset, cold_start_before_launch,
                     launch_options, launched_machines, launched_processes, launcher_type)

SFT_UNDER_DEEPSPEED = (
    "`sft_steps` (the built-in SFT cold start) cannot run inside a DeepSpeed launch: accelerate allows one DeepSpeed "
    "Accelerator per process, and the GSPO trainer needs it. Fix: launch with `trl-gspo` and an accelerate_config "
    "that selects DeepSpeed (it runs the cold start in one process before the launch, then starts the DeepSpeed "
    "processes from it), or cold-start once with one process or DDP (e.g. recipes/accelerate/cpu_ddp.yaml), then "
    "launch DeepSpeed with `model_name_or_path: <that output_dir>/initial_model` and `sft_steps: 0`."
)
SFT_UNDER_FSDP = (
    "`sft_steps` (the built-in SFT cold start) cannot run inside an FSDP launch: its SFT trainer would shard the model "
    "too, and the sharded model cannot be saved for the GSPO trainer. Fix: launch with `trl-gspo` and an "
    "accelerate_config that selects FSDP (it runs the cold start in one process before the launch), or cold-start "
    "once with one process, then launch FSDP with `model_name_or_path: <that output_dir>/initial_model` and "
    "`sft_steps: 0`."
)


FSDP_WITHOUT_ACCELERATOR = (
    "`accelerate_config`: FSDP needs a GPU (or another accelerator), and {why}: accelerate has no FSDP on CPU and "
    "would train two CPU processes with plain data parallelism instead, or fail after loading the model (measured, "
    "see docs/recipes.md). Fix: on CPU use recipes/accelerate/cpu_ddp.yaml, or cpu_zero3.yaml to shard the "
    "weights; keep fsdp1/fsdp2 for GPU machines."
)


def has_accelerator() -> bool:
    """A device accelerate can run FSDP on (CUDA, XPU, NPU, ...; not Apple's MPS)."""
    import torch

    return torch.accelerator.is_available() and torch.accelerator.current_accelerator().type != "mps"


def check_launch(script_args, training_args, model_args, launch_args: list[str], dry_run: bool = False,
                 precision_overridden: bool = False) -> list[str]:
    """Refuse (`RecipeError`) a launcher the recipe cannot run on, or one that overrides its precision
    (`effective.check_agreement`); returns notes for a dry run, the effective settings first.
    `precision_overridden`: the dry run replaced the recipe's bf16 (no GPU here), so its precision is not compared.

    A dry run validates a GPU recipe on a machine without one, so what only the launch machine can decide (is there
    an accelerator for FSDP) is a note there and an error at launch.
    """
    from .effective import Launcher, check_agreement, resolve
    from .multinode import launch_problems

    settings = resolve(training_args, model_args, Launcher.from_launch_args(launch_args))
    notes = ["effective settings (after the launcher):", *(f"  {line}" for line in settings.lines())] if dry_run else []
    distributed_type = launcher_type(launch_args)
    problems = launch_problems(*launch_options(launch_args), distributed_type, training_args.save_on_each_node)
    if problems:
        raise RecipeError("\n  ".join(problems))
    if training_args.ddp_backend and distributed_type != "DEEPSPEED" and launched_processes(launch_args) == 1:
        raise RecipeError(
            f"`ddp_backend: {training_args.ddp_backend}` sets the process group of a multi-process launch, and this "
            "launch starts one process, where accelerate fails with \"Default process group has not been "
            "initialized\". Fix: remove ddp_backend, or launch several processes (e.g. `accelerate_config: "
            "recipes/accelerate/cpu_ddp.yaml` on CPU, `num_processes: 8` on a GPU node)."
        )
    if distributed_type in COLD_START_LAUNCHERS and script_args.sft_steps > 0:
        kind = COLD_START_LAUNCHERS[distributed_type]
        if not cold_start_before_launch(script_args, model_args, launch_args):  # not a built-in model
            raise RecipeError(
                f"`sft_steps` {script_args.sft_steps} cold-starts a `builtin:` model, and model_name_or_path is "
                f"{model_args.model_name_or_path!r} (a {kind} process could not run an SFT stage either). Fix: set "
                "sft_steps: 0, or cold-start your model with `trl sft` first.")
        if launched_machines(launch_args) > 1:  # every node's command would cold-start into the shared output_dir
            raise RecipeError(
                f"`sft_steps` with {kind} on several nodes: `trl-gspo` runs the built-in cold start in one process "
                f"before a {kind} launch, and each node's command would run its own into the shared output_dir. "
                "Fix: cold-start once, on one node: `python -m trl_gspo.launch.train cold-start --config RECIPE` (what "
                "trl-gspo runs before a one-node launch; it writes <output_dir>/initial_model), then launch every node "
                "with `--model_name_or_path <output_dir>/initial_model --sft_steps 0`.")
        notes.append(f"(the built-in cold start, sft_steps {script_args.sft_steps}, runs in one process before the "
                     f"{kind} launch, into "
                     f"{os.path.join(training_args.output_dir, 'initial_model')}; the {kind} processes start from "
                     "it with sft_steps 0)")
    if distributed_type == "FSDP":
        if training_args.use_cpu and has_accelerator():
            raise RecipeError(FSDP_WITHOUT_ACCELERATOR.format(why="the recipe sets `use_cpu: true`"))
        if not has_accelerator():
            message = FSDP_WITHOUT_ACCELERATOR.format(why="this machine has none")
            if not dry_run:
                raise RecipeError(message)
            notes.append(f"(launching here would be refused: {message})")
    if not precision_overridden:  # after the launcher's own refusals: a launcher that cannot run comes first
        check_agreement(settings)
    return notes


def check_recipe(script_args, training_args, model_args, dataset_args, launch_args: list[str] | None = None,
                 probe_dataset: bool = True, unchecked: list | None = None) -> None:
    """Everything about a recipe that can be checked offline and without a model; raises `RecipeError` naming the
    key and the fix. Run by `trl-gspo` (also for `--dry_run`) before anything is launched, with its `accelerate
    launch` options, and by each launched process before it loads a model (`launch_args=None`, `probe_dataset=False`:
    it loads the dataset right after and checks its size exactly). `unchecked`, a dry run's list: a hub model or
    dataset neither local nor cached while the Hub is offline or unreachable is appended to it as `(item, what was
    not checked)`, with the checks that need it (the dataset size), instead of refused (`format_unchecked`)."""
    args = training_args  # its numbers (sizes, learning_rate, max_steps, ...) are range-checked by the config itself
    _check_output_dir(args.output_dir)
    _check_model(model_args)
    if script_args.sft_steps and not (script_args.dataset_name or "").startswith(BUILTIN_PREFIX):
        raise RecipeError("`sft_steps` needs a `builtin:` dataset (it trains on the task's reference answers). "
                          "Fix: set sft_steps: 0, or cold-start your model with `trl sft` first.")
    _check_builtin_pair(script_args, model_args)
    if script_args.trainer == "async":
        _check_async(script_args, args, model_args)
    else:
        _check_tools(script_args, args, model_args)
    listed = len(unchecked) if unchecked is not None else 0
    size = _dataset_size(script_args, dataset_args, probe_dataset, unchecked)
    size_unknown_here = unchecked is not None and len(unchecked) > listed and bool(script_args.dataset_name)
    if probe_dataset and not model_args.model_name_or_path.startswith(BUILTIN_PREFIX):
        try:
            _probe_model("model_name_or_path", model_args.model_name_or_path, **_model_hub_options(model_args, args))
        except ValueError as err:  # a RecipeError, or the ModelSourceError behind it
            if unchecked is None or not _hub_item_unavailable(err):
                raise
            unchecked.insert(listed, ("model_name_or_path", (f"{model_args.model_name_or_path}: that it exists; "
                                                             "its config, tokenizer and chat template")))
    # The asynchronous trainer's rollout worker cycles the prompts as long as training runs: any size serves.
    if launch_args is not None and script_args.trainer != "async":
        if size is not None:
            check_dataset_size(size, args, script_args, launched_processes(launch_args))
        elif size_unknown_here:
            prompts, completions, _ = _rollout_batch(args, script_args, launched_processes(launch_args))
            unchecked.append(("dataset size", (f"its '{script_args.dataset_train_split}' split needs at least "
                                               f"{prompts} prompts (one rollout batch: {prompts} x "
                                               f"{args.num_generations} = {completions} completions)")))


class HubUnavailable(RecipeError):
    """A hub dataset neither local nor cached while the Hub is offline or unreachable: refused before a run, listed
    as not checked by a dry run."""


def hub_unavailable() -> str | None:
    """Why the Hub cannot be asked from here (offline mode, or no connection: `hub_unreachable_once`), or None."""
    import datasets
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        return "offline mode is on, HF_HUB_OFFLINE"
    unreachable = hub_unreachable_once(constants.ENDPOINT)
    return f"it cannot be reached, {unreachable}" if unreachable else None


def _hub_item_unavailable(err: Exception) -> bool:
    """`err`, from `_probe_model`, says that the model is neither local nor cached (`ModelSourceError`, which it
    rewords) while the Hub cannot be asked: not an option that transformers' `local_files_only` makes fail anyway."""
    source = err if isinstance(err, ModelSourceError) else err.__context__
    return isinstance(source, ModelSourceError) and hub_unavailable() is not None


def format_unchecked(unchecked: list) -> str:
    """A dry run's block of what it could not check on this machine, one `(item, what)` a line."""
    why = hub_unavailable() if {item for item, _ in unchecked} & {"model_name_or_path", "dataset_name", "datasets"} \
        else None
    lines = [f"not checked on this machine{f' (the Hub: {why})' if why else ''}; the run checks them when it starts:"]
    order = ["model_name_or_path", "tokenizer", "dataset_name", "datasets", "dataset size"]
    ranked = sorted(unchecked, key=lambda entry: order.index(entry[0]) if entry[0] in order else len(order))
    lines += [f"  {item:<19} {what}" for item, what in ranked]
    return "\n".join(lines)


def _check_async(script_args, training_args, model_args) -> None:
    """`trainer: async`: what AsyncGSPOTrainer takes differently from GSPOTrainer."""
    if script_args.failed_tool_credit is not None:
        raise RecipeError("`failed_tool_credit` trains with ToolCreditGSPOTrainer, a synchronous trainer. Fix: remove "
                          "it, or use trainer: sync.")
    if model_args.model_name_or_path.startswith(BUILTIN_PREFIX) or (script_args.dataset_name or "").startswith(
            BUILTIN_PREFIX):
        raise RecipeError("`trainer: async` samples with a vLLM server started on the model beforehand; the built-in "
                          "tiny models and tasks are built inside the run. Fix: a hub id or a saved model directory "
                          "and a dataset, or trainer: sync for the built-in quickstart.")
    if not training_args.vllm_server_base_url.startswith(("http://", "https://")):
        raise RecipeError(f"`vllm_server_base_url`: {training_args.vllm_server_base_url!r} is not an http(s) URL. "
                          "Fix: the server's address, e.g. http://10.0.0.5:8000 (`trl-gspo vllm-serve` on its GPUs).")


def check_dataset_size(size: int, training_args, script_args, processes: int = 1, launched: bool = False) -> None:
    """Refuse a training split smaller than one rollout batch: TRL's sampler keeps only whole rollout batches, so the
    run would end after 0 optimizer steps and save an untrained model. In a launched process (`launched=True`)
    `generation_batch_size` already counts every process; before launch it is per process unless set explicitly."""
    args = training_args
    prompts, completions, batch = _rollout_batch(args, script_args, processes, launched)
    if size < prompts:
        raise RecipeError(
            f"the training split has {size} prompts, fewer than one rollout batch: {prompts} prompts x "
            f"{args.num_generations} generations = {completions} completions ({batch}); no optimizer step would "
            f"run. Fix: use a larger dataset"
            f"{' (builtin_num_examples)' if (script_args.dataset_name or '').startswith(BUILTIN_PREFIX) else ''}, "
            "or lower per_device_train_batch_size / steps_per_generation."
        )


def _rollout_batch(training_args, script_args, processes: int, launched: bool = False) -> tuple[int, int, str]:
    """`(prompts, completions, how the completions are counted)` of one rollout batch (`check_dataset_size`)."""
    args = training_args
    explicit = "generation_batch_size" in getattr(script_args, "explicit_keys", ())
    completions = args.generation_batch_size * (1 if explicit or launched else processes)
    batch = (f"generation_batch_size={completions}" if explicit else
             f"per_device_train_batch_size={args.per_device_train_batch_size} x {processes} process(es) x "
             f"steps_per_generation={args.steps_per_generation}")
    return completions // args.num_generations, completions, batch


def _check_output_dir(output_dir: str) -> None:
    """`output_dir` can be created and written: probed with a temporary directory in it, or in its nearest existing
    parent (removed again), so a run does not train for minutes and then fail to save."""
    import tempfile

    path = os.path.abspath(output_dir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RecipeError(f"`output_dir`: {existing} is a file, so {output_dir!r} cannot be created. Fix: choose "
                          "another output_dir.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".trl-gspo-probe-", dir=existing))
    except OSError as err:
        raise RecipeError(f"`output_dir`: cannot create {output_dir!r} ({err.strerror} in {existing}). Fix: choose "
                          "a writable output_dir.") from None


def _check_model(model_args) -> None:
    name = model_args.model_name_or_path
    if not name:
        raise RecipeError("`model_name_or_path` is not set. Fix: builtin:tiny-qwen3-moe, a hub id or a local path.")
    if name.startswith(BUILTIN_PREFIX) and name[len(BUILTIN_PREFIX):] not in BUILTIN_MODELS:
        raise RecipeError(f"`model_name_or_path`: unknown built-in {name!r}"
                          f"{did_you_mean(name, [BUILTIN_PREFIX + m for m in BUILTIN_MODELS])}. Fix: use one of "
                          f"{[BUILTIN_PREFIX + m for m in BUILTIN_MODELS]} or a hub id / local path.")


def _model_hub_options(model_args, training_args) -> dict:
    """Where the launched run loads the model from (`launch.train` passes these to `from_pretrained`):
    `model_revision`, overridden by `model_init_kwargs`' revision, cache_dir, subfolder, token, local_files_only."""
    return hub_options({"revision": model_args.model_revision, **(training_args.model_init_kwargs or {})})


def _probe_model(key: str, name: str, **where) -> None:
    """A hub model that is neither a local path, nor cached where `where` says, nor reachable: one line
    (`trl_gspo.trainer.model_checks.check_model_source`)."""
    try:
        check_model_source(name, key, **where)
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _builtin(name: str | None) -> str | None:
    return name[len(BUILTIN_PREFIX):] if name and name.startswith(BUILTIN_PREFIX) else None


def _check_builtin_pair(script_args, model_args) -> None:
    """A built-in model with a built-in dataset: the task must be the model's (its tokenizer writes the task's
    prompts, its cold start trains on the task's transcripts)."""
    model, dataset = _builtin(model_args.model_name_or_path), _builtin(script_args.dataset_name)
    if model in BUILTIN_MODELS and dataset in BUILTIN_TASK_MODELS and model not in BUILTIN_TASK_MODELS[dataset]:
        task = next(t for t, models in BUILTIN_TASK_MODELS.items() if model in models)
        raise RecipeError(
            f"`model_name_or_path: builtin:{model}` is the model of the built-in task builtin:{task}, not of "
            f"`dataset_name: builtin:{dataset}`. Fix: use model_name_or_path: "
            f"builtin:{BUILTIN_TASK_MODELS[dataset][0]} with builtin:{dataset}, or dataset_name: builtin:{task}.")
    if model == "tiny-qwen3-moe-tools" and "sft_correct_fraction" in getattr(script_args, "explicit_keys", ()):
        raise RecipeError("`sft_correct_fraction` applies to the builtin:addition cold start; builtin:tiny-qwen3-moe-"
                          "tools is cold-started on correct tool-call transcripts only, so it would be ignored. Fix: "
                          "remove sft_correct_fraction (sft_steps and sft_learning_rate apply).")


def _check_tools(script_args, training_args, model_args) -> None:
    """`tools`, `environment_factory` and `failed_tool_credit` against the loss type, the dataset and the model;
    names (and a string where a list belongs) are checked by `trl_gspo.launch.tool_registry.resolve_tools`."""
    tools, environment = script_args.tools, script_args.environment_factory
    credit = script_args.failed_tool_credit
    uses_tools = bool(tools or environment)
    if credit is not None:
        if not math.isfinite(credit):
            raise RecipeError(f"`failed_tool_credit` must be a finite number, got {credit}. Fix: e.g. "
                              "failed_tool_credit: -0.5.")
        if training_args.loss_type != "gspo_token":
            raise RecipeError(
                f"`failed_tool_credit` trains with ToolCreditGSPOTrainer, whose per-turn credit only loss_type: "
                f"gspo_token uses (with loss_type: {training_args.loss_type} it would be silently ignored). Fix: set "
                "loss_type: gspo_token, or remove failed_tool_credit.")
        if not uses_tools:
            raise RecipeError("`failed_tool_credit` credits the turns of failed tool calls, and the recipe gives the "
                              "model no tools. Fix: add `tools: [add]` (or `environment_factory: CalculatorEnv`), or "
                              "remove failed_tool_credit.")
    dataset, model = _builtin(script_args.dataset_name), _builtin(model_args.model_name_or_path)
    if uses_tools:
        key = "tools" if tools else "environment_factory"
        if dataset in BUILTIN_DATASETS and dataset not in CONVERSATIONAL_BUILTIN_DATASETS:
            raise RecipeError(
                f"`{key}` needs a conversational dataset (prompts as lists of messages, rendered with the chat "
                f"template and the tools), and builtin:{dataset} has plain-text prompts. Fix: use dataset_name: "
                "builtin:tool_addition (with model_name_or_path: builtin:tiny-qwen3-moe-tools), or remove "
                f"{key}.")
        if model in BUILTIN_MODELS and model != "tiny-qwen3-moe-tools":
            raise RecipeError(
                f"`{key}`: builtin:{model}'s tokenizer has no chat template, so it cannot render tools or parse tool "
                "calls. Fix: use model_name_or_path: builtin:tiny-qwen3-moe-tools, or a model whose chat template "
                "supports tools.")
    elif dataset in CONVERSATIONAL_BUILTIN_DATASETS:
        raise RecipeError(f"`dataset_name: builtin:{dataset}` is answered through the calculator tool "
                          "(tool_answer_reward pays only an answer that used it), and the recipe gives the model no "
                          "tools. Fix: add `tools: [add]` or `environment_factory: CalculatorEnv`.")


def check_conversational(script_args, train_dataset) -> None:
    """With tools, refuse a loaded dataset whose prompts are plain text (TRL's tool loop renders messages); called by
    the launched process after loading the dataset, before the model."""
    if not (script_args.tools or script_args.environment_factory) or not hasattr(train_dataset, "__len__"):
        return
    from trl.data_utils import is_conversational

    if len(train_dataset) and not is_conversational(train_dataset[0]):
        key = "tools" if script_args.tools else "environment_factory"
        raise RecipeError(
            f"`{key}` needs a conversational dataset (a `prompt` column of message lists), and "
            f"{script_args.dataset_name or 'the dataset'}'s prompts are plain text. Fix: convert the prompts to "
            "`[{\"role\": \"user\", \"content\": ...}]`, or remove " + key + ".")


def _dataset_size(script_args, dataset_args, probe: bool, unchecked: list | None = None) -> int | None:
    """The training split's number of prompts where it is known without loading the data (`None` otherwise); checks
    that the dataset exists: a built-in name, a local path, or a hub id `datasets` can resolve (its metadata only).
    A hub dataset the Hub cannot be asked about is appended to `unchecked` (a dry run's list) instead of refused."""
    name = script_args.dataset_name
    if name and dataset_args.datasets:  # `trl grpo` would use `datasets` and only log that `dataset_name` is ignored
        raise RecipeError(f"both `dataset_name` ({name!r}) and `datasets` are set; one of them would be ignored. "
                          "Fix: keep one (list several datasets under `datasets`).")
    if name and name.startswith(BUILTIN_PREFIX):
        _check_builtin_dataset(name)
        return script_args.builtin_num_examples
    if dataset_args.datasets:
        for entry in dataset_args.datasets:
            if probe:
                _probe_or_list(unchecked, f"{entry.path}: that it exists", "datasets", entry.path, entry.name,
                               data_dir=entry.data_dir, data_files=entry.data_files)
        return None
    if not name:
        raise RecipeError("no dataset: set `dataset_name` (e.g. builtin:addition or a hub id) or `datasets`.")
    if not probe:
        return None
    info = _probe_or_list(unchecked, f"{name}: that it exists, with a '{script_args.dataset_train_split}' split",
                          "dataset_name", name, script_args.dataset_config)
    split = (info.splits or {}).get(script_args.dataset_train_split) if info is not None else None
    return split.num_examples if split is not None and split.num_examples else None


def _probe_or_list(unchecked: list | None, what: str, key: str, *probe, **data):
    """`_probe_dataset(key, *probe, **data)`; a dataset it finds unavailable (`HubUnavailable`) is appended to
    `unchecked` as `(key, what)` when that is a list (a dry run), else refused."""
    try:
        return _probe_dataset(key, *probe, **data)
    except HubUnavailable:
        if unchecked is None:
            raise
        unchecked.append((key, what))
        return None


class _CacheOnly:
    """`datasets` and `huggingface_hub` in offline mode (the cache only) inside the block, as with HF_HUB_OFFLINE=1."""

    def __enter__(self):
        import datasets
        from huggingface_hub import constants

        self.saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True

    def __exit__(self, *exc):
        import datasets
        from huggingface_hub import constants

        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = self.saved


def _probe_dataset(key: str, path: str, config_name: str | None, **data):
    """The `DatasetInfo` of a hub dataset (metadata only, from the cache when offline or when the Hub cannot be
    reached); `None` for a local path."""
    if os.path.exists(path):
        return None
    import contextlib

    import datasets
    from huggingface_hub import constants

    offline = datasets.config.HF_HUB_OFFLINE
    unreachable = None if offline else hub_unreachable_once(constants.ENDPOINT)
    try:
        with _CacheOnly() if unreachable else contextlib.nullcontext():
            return datasets.load_dataset_builder(path, config_name, **data).info
    except Exception as err:  # ConnectionError offline, DatasetNotFoundError, a wrong config name, ...
        from huggingface_hub.utils import validate_repo_id

        try:  # datasets cannot ask the Hub about a hub id it has not cached (a missing local path is no hub id)
            missing = isinstance(err, ConnectionError) and validate_repo_id(path) is None
        except ValueError:
            missing = False
        if unreachable:  # datasets' own error would only say that offline mode is on
            raise (HubUnavailable if missing else RecipeError)(
                f"`{key}`: {path!r} is neither a local path nor a cached dataset, and the Hub cannot be reached from "
                f"here ({unreachable}). Fix: check the network (or HF_ENDPOINT, a proxy), give a local path, or "
                "download it once online."
            ) from None
        offline = " (offline mode: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set and it is not cached)" if offline else ""
        raise (HubUnavailable if offline and missing else RecipeError)(
            f"`{key}`: {path!r} is neither a local path nor a dataset `datasets` can load{offline}: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Fix: check the name"
            f"{' and dataset_config' if config_name else ''}, give a local path, or download it once online."
        ) from None
