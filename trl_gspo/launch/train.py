"""Training entry point: `python -m trl_gspo.launch.train --config recipe.yaml` (what `trl-gspo` launches).

Also runs under `accelerate launch [options] -m trl_gspo.launch.train --config recipe.yaml`.
`python -m trl_gspo.launch.train cold-start --config recipe.yaml` only prepares the built-in model (with its SFT cold
start) in this one process: what `trl-gspo` runs before a DeepSpeed launch, whose processes cannot run the SFT.
Imports flow one way: the command (`trl_gspo.launch.cli`) launches this module by name, this module uses `recipe`,
`checks`, `rewards` and the trainer.
"""

from __future__ import annotations

import os
import sys
import time

from ..config import did_you_mean
from . import quiet
from .checks import (FSDP_WITHOUT_ACCELERATOR, SFT_UNDER_DEEPSPEED, SFT_UNDER_FSDP, check_conversational,
                     check_dataset_size, check_recipe)
from .effective import check_agreement
from .effective import resolve as resolve_settings
from .recipe import (BUILTIN_MODELS, BUILTIN_PREFIX, COLD_START_NOTE_ENV, COLD_START_SECONDS_ENV, RecipeError,
                     describe, load_dataset, parse_recipe)
from .rewards import resolve_rewards
from .tool_registry import resolve_tools

# Global batch of the tool model's SFT cold start (split over the processes, like the addition model's 64).
TOOL_SFT_BATCH = 16


def _prepare_builtin_model(script_args, training_args, model_args, timing: dict | None = None):
    """Build the tiny model and tokenizer, optionally SFT cold-start them, and save them under `output_dir` so
    TRL can load them by path (the reference model for `beta > 0` is reloaded from that path too). `timing`, when
    given, gets `seconds` (None when a prepared model was reused)."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from ..quickstart import model as builtin_models
    from ..quickstart.addition import make_sft_dataset
    from ..quickstart.cold_start import sft_cold_start
    from ..quickstart.tokenizer import build_tokenizer

    name = model_args.model_name_or_path[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_MODELS:
        builtins = [BUILTIN_PREFIX + m for m in BUILTIN_MODELS]
        raise RecipeError(f"`model_name_or_path`: unknown built-in {model_args.model_name_or_path!r}"
                          f"{did_you_mean(model_args.model_name_or_path, builtins)}. Fix: use one of {builtins} or a "
                          "hub id / local path.")
    path = os.path.join(training_args.output_dir, "initial_model")
    state = PartialState()
    under_deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") or bool(training_args.deepspeed)
    if script_args.sft_steps > 0 and under_deepspeed:
        raise RecipeError(SFT_UNDER_DEEPSPEED)
    if script_args.sft_steps > 0 and parse_flag_from_env("ACCELERATE_USE_FSDP"):
        raise RecipeError(SFT_UNDER_FSDP)
    from ..quickstart import reuse

    inputs = reuse.cold_start_inputs(name, script_args, training_args.seed, state.num_processes)
    reusable = reuse.reusable(path, inputs)
    state.wait_for_everyone()  # every rank has looked before rank 0 may start rewriting the directory
    if reusable:
        if state.is_main_process:
            print(f"[trl-gspo] reusing the prepared model in {path} (same inputs: {reuse.MARK})", flush=True)
        if timing is not None:
            timing["seconds"] = None
        return path
    started = time.perf_counter()
    if state.is_main_process and script_args.sft_steps > 0:
        print(f"[trl-gspo] supervised cold start: {script_args.sft_steps} steps", flush=True)
    # Every rank builds the model from the same seed (the same weights) and takes part in the cold start: SFTTrainer
    # is distributed itself (its sampler splits the batch), and an SFT run on rank 0 alone would pair its collectives
    # with the other ranks' barrier and release them too early.
    if name == "tiny-qwen3-moe-tools":  # trl_gspo/quickstart/tools.py: SFT on tool-call transcripts
        from ..quickstart.tools import build_tool_model

        model, tokenizer = build_tool_model(sft_steps=script_args.sft_steps, seed=training_args.seed,
                                            learning_rate=script_args.sft_learning_rate,
                                            per_device_train_batch_size=max(TOOL_SFT_BATCH // state.num_processes, 1),
                                            use_cpu=training_args.use_cpu)  # where the run that follows runs
    else:
        tokenizer = build_tokenizer()
        build = builtin_models.build_model if name == "tiny-qwen3-moe" else builtin_models.build_dense_model
        model = build(tokenizer, seed=training_args.seed)
        if script_args.sft_steps > 0:
            sft_data = make_sft_dataset(script_args.sft_steps * 64, seed=training_args.seed,
                                        correct_fraction=script_args.sft_correct_fraction)
            model = sft_cold_start(model, tokenizer, os.path.join(training_args.output_dir, "sft"),
                                   max_steps=script_args.sft_steps, seed=training_args.seed,
                                   dataset=sft_data, per_device_train_batch_size=max(64 // state.num_processes, 1),
                                   learning_rate=script_args.sft_learning_rate,
                                   use_cpu=training_args.use_cpu)  # where the run that follows runs
    if state.is_main_process and script_args.sft_steps > 0:
        print(f"[trl-gspo] cold start done in {time.perf_counter() - started:.0f}s", flush=True)
    if state.is_main_process:
        reuse.clear_mark(path)  # a kill while the files below are rewritten must not leave the old mark behind
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        reuse.write_mark(path, inputs)  # last: a run killed before this prepares the model again
    state.wait_for_everyone()
    if timing is not None:
        timing["seconds"] = time.perf_counter() - started
    return path


def check_distributed_setup(training_args) -> None:
    """Refuse an FSDP launch that accelerate would run without FSDP: on CPU it falls back to plain data parallelism
    (FSDP2) or fails after the model is loaded (FSDP1), for `accelerate launch -m trl_gspo.launch.train` run by hand
    too."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, parse_flag_from_env

    state = PartialState(cpu=training_args.use_cpu)
    # PartialState never says FSDP itself: on a GPU it says MULTI_GPU (XPU, NPU, ...), which AcceleratorState then
    # upgrades to FSDP; on the CPU it says MULTI_CPU or NO, which accelerate never upgrades.
    accelerator_types = {getattr(DistributedType, name) for name in ("FSDP", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU",
                                                                     "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                                                                     "MULTI_HPU", "MULTI_NEURON")
                         if hasattr(DistributedType, name)}
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and state.distributed_type not in accelerator_types:
        raise RecipeError(FSDP_WITHOUT_ACCELERATOR.format(
            why=f"this process runs on {state.device} (accelerate chose {state.distributed_type.value})"))


def check_checkpoint_storage(training_args) -> None:
    """On several nodes: refuse, before any model loads, an output_dir the nodes do not share (no node could resume
    its checkpoints) and `save_on_each_node` (`multinode.storage_problem` says why). Every process reaches the same
    answer."""
    from accelerate.utils import parse_flag_from_env

    from . import multinode

    if multinode.nodes()[1] <= 1:
        return
    deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") or bool(training_args.deepspeed)
    shared = multinode.output_dir_is_shared(training_args.output_dir)
    problem = multinode.storage_problem(shared, training_args.save_on_each_node, deepspeed, training_args.output_dir)
    if problem:
        raise RecipeError(problem)


def run(script_args, training_args, model_args, dataset_args) -> "GSPOTrainer":  # noqa: F821
    from trl import get_peft_config, get_quantization_config

    from ..trainer import GSPOTrainer
    from .reporting import RunReportCallback

    check_recipe(script_args, training_args, model_args, dataset_args, probe_dataset=False)
    check_agreement(resolve_settings(training_args, model_args))  # the launcher this process runs under
    check_distributed_setup(training_args)
    check_checkpoint_storage(training_args)
    rewards = resolve_rewards(script_args)
    tools = resolve_tools(script_args)  # {} or tools= / environment_factory= for TRL's tool loop
    dataset = load_dataset(script_args, dataset_args)
    splits = {"dataset_train_split": script_args.dataset_train_split}
    if training_args.eval_strategy != "no":
        splits["dataset_test_split"] = script_args.dataset_test_split
    for key, split in splits.items():
        if split not in dataset:
            raise RecipeError(f"`{key}`: the dataset has no split {split!r} (it has {sorted(dataset)}). Fix: set "
                              f"{key} to one of them{' or eval_strategy: no' if key == 'dataset_test_split' else ''}.")
    train_dataset = dataset[script_args.dataset_train_split]
    if hasattr(train_dataset, "__len__") and script_args.trainer != "async":  # exact: counts every launched process
        from accelerate import PartialState

        check_dataset_size(len(train_dataset), training_args, script_args, PartialState().num_processes, launched=True)
    check_conversational(script_args, train_dataset)

    model = model_args.model_name_or_path
    if script_args.trainer == "async":
        return _run_async(model, rewards, training_args, model_args, train_dataset, tools, script_args.plot)
    cold_start = None  # the run summary's phrase for the cold start's wall time
    if model.startswith(BUILTIN_PREFIX):
        timing = {}
        model = _prepare_builtin_model(script_args, training_args, model_args, timing)
        cold_start = _cold_start_phrase(timing["seconds"], script_args.sft_steps)
    elif os.environ.get(COLD_START_NOTE_ENV):  # the cold start ran (or was reused) before this launch
        seconds = os.environ.get(COLD_START_SECONDS_ENV)
        cold_start = _cold_start_phrase(float(seconds) if seconds else None, sft_steps=1)
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    trainer_class, credit = GSPOTrainer, {}
    if script_args.failed_tool_credit is not None:  # per-turn credit for failed tool calls (gspo_token only)
        from ..turn_advantages import ToolCreditGSPOTrainer

        trainer_class, credit = ToolCreditGSPOTrainer, {"failed_tool_credit": script_args.failed_tool_credit}
    # Printed last, once the model is saved (and the progress bar closed), with the whole command's wall time.
    report = RunReportCallback(plot=script_args.plot, notes=[os.environ[COLD_START_NOTE_ENV]]
                               if os.environ.get(COLD_START_NOTE_ENV) else [], cold_start=cold_start, deferred=True)
    trainer = trainer_class(
        model=model,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        callbacks=[report],
        **tools,
        **credit,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    import torch.distributed

    on_gloo = torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    trainer.end()
    if on_gloo:
        # A gloo worker thread may still be freeing the last all_gather, which needs the GIL; if the interpreter is
        # finalizing by then, torch aborts the process (SIGABRT) after a successful run. Yielding the GIL briefly
        # lets it finish (docs/recipes.md, 'Known issue on CPU').
        time.sleep(0.1)
    report.print_summary()
    return trainer


def _cold_start_phrase(seconds: float | None, sft_steps: int) -> str:
    """How the run summary names the built-in model's preparation: its seconds, or that it was reused."""
    if seconds is None:
        return "cold start reused"
    return f"cold start {seconds:.0f}s" if sft_steps > 0 else f"model preparation {seconds:.0f}s"


def _run_async(model: str, rewards, training_args, model_args, train_dataset, tools: dict, plot: bool = True):
    """`trainer: async`: AsyncGSPOTrainer against the vLLM server at `vllm_server_base_url`. TRL's asynchronous
    trainer loads the model itself (as `model_init_kwargs` say, with its tree attention) and reads checkpoints'
    `rollout_state.json` on resume. Ends with the same run summary and training curves as the synchronous trainer."""
    from trl import get_peft_config

    from ..async_trainer import AsyncGSPOTrainer
    from .reporting import RunReportCallback

    model_init_kwargs = dict(revision=model_args.model_revision)  # dtype, trust_remote_code: the config's own keys
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    report = RunReportCallback(plot=plot, deferred=True)  # printed last, once the model is saved
    trainer = AsyncGSPOTrainer(model=model, reward_funcs=rewards, args=training_args, train_dataset=train_dataset,
                               peft_config=get_peft_config(model_args), callbacks=[report], **tools)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    report.print_summary()
    return trainer


def cold_start(argv: list[str]) -> int:
    """`python -m trl_gspo.launch.train cold-start <recipe arguments>`: prepare the built-in model in this one
    process (no accelerate launch, no DeepSpeed) and save it to `<output_dir>/initial_model`, or reuse it there."""
    try:
        # before_launch: this process sets up no process group, whatever `ddp_backend` the launch that follows uses
        script_args, training_args, model_args, dataset_args, _, _ = parse_recipe(argv, before_launch=True)
        if not (model_args.model_name_or_path or "").startswith(BUILTIN_PREFIX):
            raise RecipeError(f"`cold-start` prepares a `builtin:` model, and model_name_or_path is "
                              f"{model_args.model_name_or_path!r}. Fix: train it with `trl-gspo` directly.")
        check_recipe(script_args, training_args, model_args, dataset_args, probe_dataset=False)
    except (ValueError, TypeError) as err:  # RecipeError is a ValueError
        print(f"trl-gspo: error: {err}", file=sys.stderr)
        return 2
    try:
        path = _prepare_builtin_model(script_args, training_args, model_args)
    except RecipeError as err:  # only our own refusals: an error inside the SFT keeps its traceback
        print(f"trl-gspo: error: {err}", file=sys.stderr)
        return 2
    print(f"[trl-gspo] prepared model: {path}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet.install()  # third-party warnings a run cannot act on (trl_gspo/launch/quiet.py)
    if argv and argv[0] == "cold-start":
        return cold_start(argv[1:])
    try:
        # A recipe that does not parse (a wrong type, an impossible value) is one line, as in `trl-gspo`.
        script_args, training_args, model_args, dataset_args, launch_args, _ = parse_recipe(argv)
    except (ValueError, TypeError) as err:
        print(f"trl-gspo: error: {err}", file=sys.stderr)
        return 2
    if script_args.dry_run:
        print(describe(script_args, training_args, model_args, dataset_args, launch_args))
        return 0
    try:
        run(script_args, training_args, model_args, dataset_args)
    except RecipeError as err:  # only our own refusals: an error inside training keeps its traceback
        print(f"trl-gspo: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
