"""The `trl-gspo` command: a twin of `trl grpo` that knows `GSPOConfig` and the built-in offline quickstart.

    trl-gspo recipe.yaml [--any_field value ...]       (or: trl-gspo --config recipe.yaml ...)
    trl-gspo vllm-serve --model M [...]                TRL's `trl vllm-serve`, plus MoE routes (sampling/serve.py)

Recipe keys are described in `trl_gspo.recipe`. The command validates the recipe, then runs
`accelerate launch -m trl_gspo.train <same arguments>`; running `accelerate launch [options] -m trl_gspo.train
--config recipe.yaml` yourself is equivalent.
"""

from __future__ import annotations

import sys

from . import launching, multinode
from .checkpoints import check_resume_before_launch
from .recipe import (GSPOScriptArguments, RecipeError, check_launch, check_recipe, describe,  # noqa: F401
                     launch_options, make_parser, parse_recipe)
from .rewards import resolve_rewards
from .tool_registry import resolve_tools, tool_budget_warning

USAGE = """usage: trl-gspo RECIPE.yaml [--key value ...] [accelerate launch options]
       trl-gspo --config RECIPE.yaml [--key value ...]

Trains with GSPO (or any TRL loss type) from a TRL-style YAML recipe; command-line keys override the recipe.
  trl-gspo recipes/quickstart.yaml                 tiny model, built-in task, offline, about a minute on CPU
  trl-gspo RECIPE.yaml --dry_run true              check every key and print the resolved run, load no model
  trl-gspo --help                                  every key (GSPOConfig, ModelConfig, script and dataset keys)
  trl-gspo vllm-serve --model M [trl vllm-serve options]
                                                   TRL's vLLM server, also returning MoE routes (server-mode R3)"""

# Launched by module name: the command never imports the training code (or the trainer, or torch's models).
TRAINING_MODULE = "trl_gspo.train"


def _without(argv: list[str], tokens: list[str]) -> list[str]:
    """`argv` minus `tokens`, an ordered subsequence of it (the accelerate options given on the command line)."""
    result, pending = [], list(tokens)
    for token in argv:
        if pending and token == pending[0]:
            pending.pop(0)
        else:
            result.append(token)
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of `trl-gspo`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] == "vllm-serve":  # TRL's vLLM server, returning MoE routes too (trl_gspo/sampling/serve.py)
        from .sampling import serve

        return serve.main(argv[1:])
    note = ""
    try:
        try:
            script_args, training_args, model_args, dataset_args, launch_args, cli_launch_tokens = parse_recipe(
                argv, before_launch=True)
        except ValueError as err:
            # A GPU recipe (bf16) cannot build its TrainingArguments on a machine without a GPU; a dry run still
            # checks every key and value there, with the hardware check switched off.
            if "bf16/gpu" not in str(err):
                raise
            if "--dry_run" not in argv:
                raise RecipeError("`bf16: true` needs a GPU, and this machine has none. Fix: run on a GPU machine; "
                                  "to try the recipe on CPU add `--bf16 false --use_cpu true`; `--dry_run true` "
                                  "validates it here.") from None
            script_args, training_args, model_args, dataset_args, launch_args, cli_launch_tokens = parse_recipe(
                argv + ["--use_cpu", "true", "--bf16", "false"], before_launch=True
            )
            note = "(no GPU here: validated with use_cpu=true, bf16=false; the recipe itself asks for bf16)\n"
        check_recipe(script_args, training_args, model_args, dataset_args, launch_args)
        resolve_rewards(script_args)  # unknown names or a missing verifier fail here, before any process starts
        tools = resolve_tools(script_args)  # unknown tool / environment names, and a name given twice, too
        warning = tool_budget_warning(script_args, training_args, model_args, tools)
        note += "".join(f"{line}\n" for line in check_launch(script_args, training_args, launch_args,
                                                             dry_run=script_args.dry_run))
        check_resume_before_launch(training_args.resume_from_checkpoint, training_args.output_dir)
    except (RecipeError, ValueError, TypeError) as err:
        print(f"trl-gspo: error: {err}", file=sys.stderr)
        return 2
    if warning:
        print(f"trl-gspo: warning: {warning}", file=sys.stderr)
    if script_args.dry_run:
        print(note, end="")
        print(describe(script_args, training_args, model_args, dataset_args, launch_args))
        print("trl-gspo: recipe is valid (dry run, nothing trained).")
        return 0

    accelerate_tokens = launch_args + ["--module", TRAINING_MODULE] + _without(argv, cli_launch_tokens)
    options = launch_options(launch_args)
    note = multinode.join_note(*options)
    if note:
        print(note, flush=True)
    # A child process group: SIGINT/SIGTERM to trl-gspo stop every training process too (trl_gspo/launching.py).
    returncode = launching.run_forwarding_signals(launching.accelerate_launch_command(accelerate_tokens))
    if 0 < returncode < 128 and multinode.failure_hint(*options):  # a failure, not a stop by a signal
        print(multinode.failure_hint(*options), file=sys.stderr)
    return returncode


if __name__ == "__main__":
    raise SystemExit(main())
