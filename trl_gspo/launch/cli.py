"""The `trl-gspo` command: a twin of `trl grpo` that knows `GSPOConfig` and the built-in offline quickstart.

    trl-gspo recipe.yaml [--any_field value ...]       (or: trl-gspo --config recipe.yaml ...)
    trl-gspo vllm-serve --model M [...]                TRL's `trl vllm-serve`, plus MoE routes (sampling/serve.py)

Recipe keys are described in `trl_gspo.launch.recipe` (and checked by `trl_gspo.launch.checks`). The command
validates the recipe, then runs `accelerate launch -m trl_gspo.launch.train <same arguments>`; running
`accelerate launch [options] -m trl_gspo.launch.train --config recipe.yaml` yourself is equivalent, except under
DeepSpeed with a built-in model's `sft_steps`: there the command first runs the cold start in one plain process
(`python -m trl_gspo.launch.train cold-start <same arguments>`) and launches the DeepSpeed processes from its
`<output_dir>/initial_model` with `sft_steps 0`.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

from ..checkpoints import check_resume_before_launch
from ..config import BF16DeviceError
from . import launching, multinode, quiet
from .checks import check_launch, check_recipe, format_unchecked
from .recipe import (BUILTIN_PREFIX, COLD_START_LAUNCHERS, COLD_START_NOTE_ENV, GSPOScriptArguments,  # noqa: F401
                     COLD_START_SECONDS_ENV, COMMAND_STARTED_ENV, RecipeError, cold_start_before_launch,
                     command_started, describe, launch_options, launcher_type, make_parser, parse_recipe)
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
TRAINING_MODULE = "trl_gspo.launch.train"


def _without(argv: list[str], tokens: list[str]) -> list[str]:
    """`argv` minus `tokens`, an ordered subsequence of it (the accelerate options given on the command line)."""
    result, pending = [], list(tokens)
    for token in argv:
        if pending and token == pending[0]:
            pending.pop(0)
        else:
            result.append(token)
    return result


def _cold_start_before_launch(argv: list[str], script_args, training_args, model_args,
                              kind: str = "DeepSpeed") -> tuple[int, str, str, float | None]:
    """Prepare the built-in model in one plain process before a DeepSpeed launch (its processes cannot run the SFT:
    accelerate allows one DeepSpeed Accelerator per process; an FSDP process's SFT trainer would shard the model it
    must save), or reuse the one a run with the same inputs left.
    Returns `(exit code, path, a line for the end-of-run report, its seconds: None when reused)`."""
    from ..quickstart import reuse

    path = os.path.join(training_args.output_dir, "initial_model")
    # One process: the same inputs the cold-start process records (its SFT batch is not split over processes).
    inputs = reuse.cold_start_inputs(model_args.model_name_or_path[len(BUILTIN_PREFIX):], script_args,
                                     training_args.seed, 1)
    if reuse.reusable(path, inputs):
        print(f"[trl-gspo] cold start reused before the {kind} launch (same inputs, {reuse.MARK}): {path}",
              flush=True)
        return 0, path, f"cold start: reused before the {kind} launch (same inputs, {reuse.MARK}): {path}", None
    print(f"[trl-gspo] cold start (sft_steps {script_args.sft_steps}) runs in one process before the {kind} "
          "launch", flush=True)
    started = time.perf_counter()
    returncode = launching.run_forwarding_signals([sys.executable, "-m", TRAINING_MODULE, "cold-start", *argv])
    if returncode:
        return returncode, path, "", None
    print(f"[trl-gspo] cold start ran before the {kind} launch: {path}", flush=True)
    return 0, path, (f"cold start: ran before the {kind} launch, in one process (sft_steps "
                     f"{script_args.sft_steps}): {path}"), time.perf_counter() - started


def _asks_dry_run(argv: list[str]) -> bool:
    """Whether the command line asks for a dry run (`--dry_run`, `--dry_run true`, `--dry_run=1`, ...), read before
    the recipe parses: a dry run parses what this machine cannot run (no GPU for bf16, no vLLM)."""
    for i, token in enumerate(argv):
        if token == "--dry_run":
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "true"
        elif token.startswith("--dry_run="):
            value = token.split("=", 1)[1]
        else:
            continue
        return value.lower() in ("true", "1", "yes", "y", "t", "on")
    return False


def _vllm_unchecked(unchecked: list | None):
    """While parsing for a dry run (`unchecked` a list), a colocate R3 recipe's vLLM that is not installed here is
    listed there instead of refused (`trl_gspo.sampling.engine.vllm_unchecked`)."""
    import contextlib

    from ..sampling.engine import vllm_unchecked

    return contextlib.nullcontext() if unchecked is None else vllm_unchecked(unchecked)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `trl-gspo`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    quiet.install()  # third-party warnings a run cannot act on (quiet.py); the processes started below install it too
    if argv[0] == "vllm-serve":  # TRL's vLLM server, returning MoE routes too (trl_gspo/sampling/serve.py)
        from ..sampling import serve

        return serve.main(argv[1:])
    note = ""
    # A dry run's list of what this machine cannot check (a hub model or dataset offline, vLLM), printed last.
    unchecked, dry_run = [], _asks_dry_run(argv)
    try:
        try:
            with _vllm_unchecked(unchecked if dry_run else None):
                script_args, training_args, model_args, dataset_args, launch_args, cli_launch_tokens = parse_recipe(
                    argv, before_launch=True)
        except ValueError as err:
            # A GPU recipe (bf16) cannot build its TrainingArguments on a machine without a GPU; a dry run still
            # checks every key and value there, with the hardware check switched off.
            if not isinstance(err, BF16DeviceError):
                raise
            if not dry_run:
                raise RecipeError("`bf16: true` needs a GPU, and this machine has none. Fix: run on a GPU machine; "
                                  "to try the recipe on CPU add `--bf16 false --use_cpu true`; `--dry_run true` "
                                  "validates it here.") from None
            unchecked.clear()
            with _vllm_unchecked(unchecked):
                script_args, training_args, model_args, dataset_args, launch_args, cli_launch_tokens = parse_recipe(
                    argv + ["--use_cpu", "true", "--bf16", "false"], before_launch=True
                )
            note = "(no GPU here: validated with use_cpu=true, bf16=false; the recipe itself asks for bf16)\n"
        if not script_args.dry_run:
            unchecked = None  # a run refuses what a dry run lists
        check_recipe(script_args, training_args, model_args, dataset_args, launch_args, unchecked=unchecked)
        resolve_rewards(script_args)  # unknown names or a missing verifier fail here, before any process starts
        tools = resolve_tools(script_args)  # unknown tool / environment names, and a name given twice, too
        warning = tool_budget_warning(script_args, training_args, model_args, tools, unchecked)
        note += "".join(f"{line}\n" for line in check_launch(script_args, training_args, model_args, launch_args,
                                                             dry_run=script_args.dry_run,
                                                             precision_overridden=bool(note)))
        check_resume_before_launch(training_args.resume_from_checkpoint, training_args.output_dir)
    except (RecipeError, ValueError, TypeError) as err:
        print(f"trl-gspo: error: {err}", file=sys.stderr)
        return 2
    if warning:
        print(f"trl-gspo: warning: {warning}", file=sys.stderr)
    if script_args.dry_run:
        print(note, end="")
        print(describe(script_args, training_args, model_args, dataset_args, launch_args))
        if unchecked:
            print(format_unchecked(unchecked))
        print("trl-gspo: recipe is valid (dry run, nothing trained)"
              + (f"; {len(unchecked)} item(s) above not checked on this machine." if unchecked else "."))
        return 0

    # When this command started: the run summary's wall time counts from there.
    overrides, environment = [], {**os.environ, COMMAND_STARTED_ENV: str(command_started())}
    if training_args.use_cpu:  # DeepSpeed's accelerator is then the CPU: said, it is not looked for (one warning a
        environment.setdefault("DS_ACCELERATOR", "cpu")  # process otherwise: docs/warnings.md)
    if cold_start_before_launch(script_args, model_args, launch_args):
        kind = COLD_START_LAUNCHERS[launcher_type(launch_args)]
        returncode, path, report, seconds = _cold_start_before_launch(argv, script_args, training_args, model_args,
                                                                      kind)
        if returncode:
            return returncode
        # Last on the command line, so they override the recipe's and the command line's own values.
        overrides = ["--model_name_or_path", path, "--sft_steps", "0"]
        environment[COLD_START_NOTE_ENV] = report
        if seconds is not None:
            environment[COLD_START_SECONDS_ENV] = f"{seconds:.1f}"
    accelerate_tokens = launch_args + ["--module", TRAINING_MODULE] + _without(argv, cli_launch_tokens) + overrides
    command = launching.accelerate_launch_command(accelerate_tokens)
    if overrides:
        print(f"[trl-gspo] the {kind} processes start from it with sft_steps 0: {shlex.join(command)}", flush=True)
    options = launch_options(launch_args)
    note = multinode.join_note(*options)
    if note:
        print(note, flush=True)
    # A child process group: SIGINT/SIGTERM to trl-gspo stop every training process too (trl_gspo/launch/launching.py).
    returncode = launching.run_forwarding_signals(command, env=environment)
    if 0 < returncode < 128 and multinode.failure_hint(*options):  # a failure, not a stop by a signal
        print(multinode.failure_hint(*options), file=sys.stderr)
    return returncode


if __name__ == "__main__":
    raise SystemExit(main())
