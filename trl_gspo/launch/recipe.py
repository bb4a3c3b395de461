"""Recipes: the YAML + command-line keys of `trl-gspo`, parsed into TRL's dataclasses, summarized, and the dataset.

Used by the command (`trl_gspo.launch.cli`), by the launched entry point (`trl_gspo.launch.train`) and by the checks
(`trl_gspo.launch.checks`); imports none of them, and no trainer. Recipe keys are the fields of
`GSPOScriptArguments`, `GSPOConfig`, `trl.ModelConfig` and `trl.DatasetMixtureConfig` (exactly `trl grpo`'s keys plus
GSPO's), an `env:` mapping exported before training, and `accelerate launch` options (`accelerate_config: zero3`,
`num_processes: 8`, ...). Anything else is an error. What the keys must satisfy together lives in `checks.py`.
A recipe with `trainer: async` trains with `AsyncGSPOTrainer`: its keys are `AsyncGSPOConfig`'s (TRL's
`AsyncGRPOConfig` plus GSPO's loss types) instead of `GSPOConfig`'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, ModelConfig, TrlParser
from trl.scripts.grpo import GRPOScriptArguments

from ..config import GSPO_LOSS_TYPES, GSPOConfig, band_description, did_you_mean
from ..trainer.model_checks import BUILTIN_BUILDERS, BUILTIN_PREFIX

TRAINERS = ("sync", "async")  # `trainer:` GSPOTrainer (TRL's GRPOTrainer) or AsyncGSPOTrainer (TRL's AsyncGRPOTrainer)

BUILTIN_MODELS = tuple(BUILTIN_BUILDERS)  # "tiny-qwen3-moe", "tiny-qwen3", "tiny-qwen3-moe-tools"
BUILTIN_DATASETS = ("addition", "tool_addition")
# The built-in models each built-in task cold-starts and trains: the task's prompts need the model's tokenizer.
BUILTIN_TASK_MODELS = {"addition": ("tiny-qwen3-moe", "tiny-qwen3"), "tool_addition": ("tiny-qwen3-moe-tools",)}
# Built-in datasets whose prompts are conversations (lists of messages), which TRL's tool loop needs.
CONVERSATIONAL_BUILTIN_DATASETS = ("tool_addition",)
# The launchers whose processes cannot run the built-in cold start, as the messages name them.
COLD_START_LAUNCHERS = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP"}
# Where the cold start run before a DeepSpeed launch tells the launched processes what it did, for their report.
COLD_START_NOTE_ENV = "TRL_GSPO_COLD_START_BEFORE_LAUNCH"
# ... and how many seconds it took (absent when it was reused).
COLD_START_SECONDS_ENV = "TRL_GSPO_COLD_START_SECONDS"
# When the `trl-gspo` command started (seconds since the epoch): the run summary's wall time counts from there.
COMMAND_STARTED_ENV = "TRL_GSPO_COMMAND_STARTED"


def command_started() -> float:
    """When the command that runs this process started (seconds since the epoch): the `trl-gspo` command's start,
    which it passes to the processes it launches (`COMMAND_STARTED_ENV`), else this process's own run's start
    (`trl_gspo.launch.STARTED`)."""
    from . import STARTED

    try:
        return float(os.environ[COMMAND_STARTED_ENV])
    except (KeyError, ValueError):
        return STARTED


class RecipeError(ValueError):
    """A recipe or command line that cannot be run; the message names the key and the fix."""


@dataclass
class GSPOScriptArguments(GRPOScriptArguments):
    """`trl grpo`'s script arguments, plus the supervised cold start and the end-of-run report.

    `model_name_or_path: builtin:tiny-qwen3-moe` (or `builtin:tiny-qwen3`, dense) builds a tiny model and a
    character tokenizer locally; `dataset_name: builtin:addition` is single-digit addition with a verifiable
    answer, whose rewards are `exact_match_reward` and `digit_match_reward` (partial credit).
    `builtin:tiny-qwen3-moe-tools` with `builtin:tool_addition` is the calculator task of TRL's tool loop
    (trl_gspo/quickstart/tools.py): `tools: [add]` or `environment_factory: CalculatorEnv`, reward
    `tool_answer_reward`; `failed_tool_credit` trains it with per-turn credit (`ToolCreditGSPOTrainer`).
    """

    trainer: str = field(
        default="sync",
        metadata={
            "help": "'sync': GSPOTrainer (TRL's GRPOTrainer: generation and training take turns). 'async': "
            "AsyncGSPOTrainer (TRL's asynchronous trainer: a vLLM server at `vllm_server_base_url` samples while the "
            "trainer trains, on samples up to `max_staleness + 1` weight versions old); its keys are "
            "AsyncGSPOConfig's.",
            "choices": list(TRAINERS),
        },
    )
    sft_steps: int = field(
        default=0,
        metadata={
            "help": "Supervised cold-start steps (TRL SFTTrainer) on the built-in task's reference answers before RL, "
            "as in the GSPO paper's recipe. Only with a `builtin:` dataset. 0 disables it."
        },
    )
    sft_learning_rate: float = field(default=3e-3, metadata={"help": "Learning rate of the supervised cold start."})
    sft_correct_fraction: float = field(
        default=0.5,
        metadata={
            "help": "Fraction of cold-start completions that are correct (the rest are random answers), so the "
            "cold-started policy is weak but has the answer in its support; see trl_gspo/quickstart/addition.py."
        },
    )
    builtin_num_examples: int = field(
        default=4096, metadata={"help": "Number of prompts generated for a `builtin:` dataset."}
    )
    tools: list[str] | None = field(
        default=None,
        metadata={
            "help": "Functions the model may call in TRL's tool loop (`GRPOTrainer(tools=...)`): built-in names "
            "(`add`) or dotted paths `module.function`. Needs a conversational dataset and a chat template that "
            "renders tool calls; `max_tool_calling_iterations` bounds the turns."
        },
    )
    environment_factory: str | None = field(
        default=None,
        metadata={
            "help": "A class TRL instantiates per rollout whose public methods (besides `reset`) are tools "
            "(`GRPOTrainer(environment_factory=...)`): the built-in `CalculatorEnv` or a dotted path `module.Class`."
        },
    )
    failed_tool_credit: float | None = field(
        default=None,
        metadata={
            "help": "Train with `trl_gspo.turn_advantages.ToolCreditGSPOTrainer`: this credit (e.g. -0.5) is added to "
            "the advantage of the tokens of a turn whose tool call failed. Needs loss_type: gspo_token and tools."
        },
    )
    plot: bool = field(
        default=True,
        metadata={"help": "Write `training_curves.png` (reward and clip fractions per step) to `output_dir`."},
    )
    dry_run: bool = field(
        default=False,
        metadata={"help": "Validate the recipe, print the resolved configuration and exit without training."},
    )


class _BeforeLaunch:
    """A config as the `trl-gspo` process builds it before launching: `ddp_backend` names the process group of the
    launched processes, and TrainingArguments with it set in a process that is not one of them fails inside
    accelerate ("Default process group has not been initialized"). So the device is set up without it and the
    value is kept for the launch (`check_launch` refuses it where the launch starts one process)."""

    def __post_init__(self):
        backend, self.ddp_backend = self.ddp_backend, None
        super().__post_init__()
        self.ddp_backend = backend


class _BeforeLaunchGSPOConfig(_BeforeLaunch, GSPOConfig):
    pass


def config_class(asynchronous: bool, before_launch: bool = False) -> type:
    """The training config a recipe's keys fill: `GSPOConfig`, or `AsyncGSPOConfig` for `trainer: async`."""
    if not asynchronous:
        return _BeforeLaunchGSPOConfig if before_launch else GSPOConfig
    from ..async_trainer.config import AsyncGSPOConfig

    return type("_BeforeLaunchAsyncGSPOConfig", (_BeforeLaunch, AsyncGSPOConfig), {}) if before_launch \
        else AsyncGSPOConfig


def _async_model_config() -> type:
    """`trl.ModelConfig` without `dtype` and `trust_remote_code`, which `AsyncGRPOConfig` has too (TRL's
    asynchronous trainer loads the model itself): one key each, read from the training config."""
    import typing

    hints = typing.get_type_hints(ModelConfig)
    fields = [(f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
              for f in dataclasses.fields(ModelConfig) if f.name not in ("dtype", "trust_remote_code")]
    config = dataclasses.make_dataclass("AsyncModelConfig", fields)
    config.__post_init__ = ModelConfig.__post_init__
    return config


def make_parser(prog: str = "trl-gspo", before_launch: bool = False, asynchronous: bool = False) -> TrlParser:
    config = config_class(asynchronous, before_launch)
    model_config = _async_model_config() if asynchronous else ModelConfig
    parser = TrlParser((GSPOScriptArguments, config, model_config, DatasetMixtureConfig), prog=prog)

    def error(message: str):  # one line naming the key, instead of argparse's 200-line usage and exit
        choice = re.search(r"invalid choice: '?(.*?)'? \(choose from (.*)\)$", message)
        if choice:  # an enumerated key (TRL's `vllm_mode`, transformers' `lr_scheduler_type`, ...)
            choices = [name.strip().strip("'") for name in choice.group(2).split(",")]
            raise RecipeError(f"{message}{did_you_mean(choice.group(1), choices)}. Fix: use one of the values "
                              "listed.")
        raise RecipeError(f"{message}. Fix: give the key a value of its type (`trl-gspo --help` lists them); write "
                          "a negative number as `--key=-1e-3`.")

    parser.error = error
    # A misspelt key is an unknown key (refused with the nearest names), never argparse's prefix match: with
    # abbreviations `--num_generation` is "ambiguous" and `--learning_rat` silently sets learning_rate.
    parser.allow_abbrev = False
    return parser


def _accelerate_options() -> dict:
    """`accelerate launch`'s option strings and their argparse actions."""
    from accelerate.commands.launch import launch_command_parser

    return dict(launch_command_parser()._option_string_actions)


def _stray_tokens(tokens: list[str], options: dict) -> list[str]:
    """Tokens that are neither an option nor an option's value (TRL's parser leaves them unread)."""
    stray, expecting_value = [], False
    for token in tokens:
        if token.startswith("--"):
            key = token.split("=", 1)[0]
            takes_value = key == "--accelerate_config" or (key in options and options[key].nargs != 0)
            expecting_value = "=" not in token and takes_value
        elif expecting_value:
            expecting_value = False
        else:
            stray.append(token)
    return stray


def parse_recipe(argv: list[str], before_launch: bool = False):
    """Parse `argv` (with `--config file.yaml`) into dataclasses.

    Returns `(script_args, training_args, model_args, dataset_args, launch_args, cli_launch_tokens)`: `launch_args`
    are the `accelerate launch` options the recipe or command line named, `cli_launch_tokens` the subsequence of
    `argv` that holds the command line's own accelerate options. `script_args.explicit_keys` names the keys the
    recipe or command line set. `argv` may start with the recipe path instead of `--config PATH`. Raises
    `RecipeError` for unknown keys, empty keys and YAML syntax errors. `before_launch=True` is for the process that
    launches the training processes (it is not one of them; see `_BeforeLaunchGSPOConfig`).
    """
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    if argv and not argv[0].startswith("-"):  # `trl-gspo recipe.yaml ...` is `trl-gspo --config recipe.yaml ...`
        argv = ["--config", *argv]
    recipe_keys = []
    if "--config" in argv:
        index = argv.index("--config")
        if index + 1 >= len(argv):
            raise RecipeError("`--config` needs a path to a YAML recipe.")
        path = argv[index + 1]
        if not os.path.isfile(path):
            raise RecipeError(f"recipe file {path!r} does not exist. Fix: pass the path of a YAML recipe, "
                              "e.g. `--config recipes/quickstart.yaml`.")
        recipe = _check_recipe_file(path)
        recipe_keys = list(recipe)
    else:
        recipe = {}
    trainer = recipe.get("trainer", "sync")
    for i, token in enumerate(argv):  # the command line overrides the recipe
        if token == "--trainer" and i + 1 < len(argv):
            trainer = argv[i + 1]
        elif token.startswith("--trainer="):
            trainer = token.split("=", 1)[1]
    if trainer not in TRAINERS:
        raise RecipeError(f"`trainer`: {trainer!r} is not one of {list(TRAINERS)}{did_you_mean(trainer, TRAINERS)}. "
                          "Fix: 'sync' (GSPOTrainer) or "
                          "'async' (AsyncGSPOTrainer, TRL's asynchronous trainer).")
    parser = make_parser(before_launch=before_launch, asynchronous=trainer == "async")
    *dataclasses, config_remaining, cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    options = _accelerate_options()
    known = set(options)
    for source, remaining in (("recipe", config_remaining), ("command line", cli_remaining)):
        for token in remaining:
            if token.startswith("--") and token.split("=", 1)[0] not in known | {"--accelerate_config"}:
                key = token[2:].split("=", 1)[0]
                names = nearest_keys(key, parser, options)
                also = f" also close: {', '.join(f'`{name}`' for name in names[1:])}" if len(names) > 1 else ""
                guess = f" (did you mean `{names[0]}`?{also})" if names else ""
                fix = (f"rename it to `{names[0]}` (or the name you meant), or remove it" if names
                       else "check its spelling against `trl-gspo --help` (or remove it)")
                where = f"{_key_line(argv[argv.index('--config') + 1], key)}: " if source == "recipe" else ""
                raise RecipeError(
                    f"{where}unknown key `{key}` in the {source}{guess}: it is neither a "
                    f"{'AsyncGSPOConfig' if trainer == 'async' else 'GSPOConfig'} / ModelConfig / script field nor an "
                    f"`accelerate launch` option. Fix: {fix}."
                )
    for token in _stray_tokens(cli_remaining, options):
        hint = (" (a recipe path goes first, or after `--config`)" if token.endswith((".yaml", ".yml")) else "")
        raise RecipeError(f"unexpected `{token}` on the command line: after the recipe, arguments are `--key value` "
                          f"pairs{hint}. Fix: remove it, or add the key it is the value of.")
    if "--config" in argv:  # a recipe's relative accelerate_config path is relative to the recipe file
        config_remaining = _relative_to_recipe(config_remaining, os.path.dirname(argv[argv.index("--config") + 1]))
    if "--accelerate_config" in cli_remaining[:-1] and "--accelerate_config" in config_remaining[:-1]:
        at = config_remaining.index("--accelerate_config")  # the command line's replaces the recipe's
        config_remaining = config_remaining[:at] + config_remaining[at + 2:]
    try:
        launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    except ValueError as err:
        raise RecipeError(f"`accelerate_config`: {err}") from None
    # The keys the user set (recipe and command line), where a default and an explicit value mean different things.
    dataclasses[0].explicit_keys = frozenset(recipe_keys + [t[2:].split("=", 1)[0] for t in argv if t.startswith("--")])
    return (*dataclasses, launch_args, cli_remaining)


def nearest_keys(key: str, parser, accelerate_options: dict, limit: int = 3) -> list[str]:
    """The valid keys closest in spelling to an unknown `key` (`difflib.get_close_matches`, best first): the fields of
    the parser's dataclasses, `accelerate launch`'s options and `accelerate_config`, in their underscore spelling."""
    import difflib

    names = {option[2:].replace("-", "_") for option in [*parser._option_string_actions, *accelerate_options]
             if option.startswith("--") and not option.startswith("--no_")}
    names |= {"accelerate_config"}
    names -= {"help", "config"}
    return difflib.get_close_matches(key.replace("-", "_"), sorted(names), n=limit, cutoff=0.75)


def _key_line(path: str, key: str) -> str:
    """`path:line` of the top-level `key` in the recipe at `path` (`path` alone when it is not one)."""
    import yaml

    with open(path) as handle:
        node = yaml.compose(handle, Loader=yaml.SafeLoader)
    for key_node, _ in getattr(node, "value", []):
        if getattr(key_node, "value", None) == key:
            return f"{path}:{key_node.start_mark.line + 1}"
    return path


def _check_recipe_file(path: str) -> dict:
    """The recipe's mapping. Refuses a YAML syntax error as `file:line:column`, and keys left empty (YAML reads
    `key:` as null) where the field cannot be None, before TRL's parser turns them into a traceback or into a `None`
    that fails inside the optimizer."""
    import typing

    import yaml

    try:
        with open(path) as handle:
            recipe = yaml.safe_load(handle)
    except yaml.YAMLError as err:
        mark, context = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        if context is not None and getattr(err, "context", None):  # e.g. an unclosed `[`: where it was opened
            problem += f" ({err.context} that starts at line {context.line + 1}, column {context.column + 1})"
        raise RecipeError(f"{where}: YAML syntax error: {problem}. Fix: correct the recipe there "
                          "(`key: value`, lists as `[a, b]`).") from None
    if not isinstance(recipe, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of `key: value` lines, got {type(recipe).__name__}. "
                          "Fix: see recipes/quickstart.yaml.")
    hints = {}
    for cls in reversed((GSPOScriptArguments, GSPOConfig, ModelConfig, DatasetMixtureConfig)):
        hints.update(typing.get_type_hints(cls))
    for key, value in recipe.items():
        hint = hints.get(key)
        if value is None and hint is not None and type(None) not in typing.get_args(hint) and hint is not type(None):
            raise RecipeError(f"{_key_line(path, key)}: `{key}` is empty (YAML reads `{key}:` with no value as "
                              f"null), and it needs a `{getattr(hint, '__name__', hint)}`. Fix: give it a value, or "
                              "delete the line for the default.")
    return recipe


def _relative_to_recipe(tokens: list[str], recipe_dir: str) -> list[str]:
    tokens = list(tokens)
    if "--accelerate_config" in tokens[:-1]:
        index = tokens.index("--accelerate_config") + 1
        candidate = os.path.join(recipe_dir, tokens[index])
        if not os.path.isfile(tokens[index]) and os.path.isfile(candidate):
            tokens[index] = candidate
    return tokens


def describe(script_args, training_args, model_args, dataset_args, launch_args) -> str:
    """A short, human-readable summary of the resolved run."""
    args = training_args
    if script_args.trainer == "async":
        loss = (f"loss_type:      {args.loss_type}  (epsilon={args.epsilon}, epsilon_high={args.epsilon_high}, "
                f"delta={args.delta}; AsyncGSPOTrainer)")
        batch = (f"batch:          per_device_train_batch_size={args.per_device_train_batch_size}, "
                 f"gradient_accumulation_steps={args.gradient_accumulation_steps}, "
                 f"num_generations={args.num_generations}, token_budget={args.token_budget}")
        batch += (f"\nasync:          vllm_server_base_url={args.vllm_server_base_url}, "
                  f"max_staleness={args.max_staleness}, weight_sync_steps={args.weight_sync_steps}")
    else:
        loss = (f"loss_type:      {args.loss_type}  (epsilon={args.epsilon}, epsilon_high={args.epsilon_high}, "
                f"beta={args.beta}, importance_sampling_level={args.importance_sampling_level})")
        batch = (f"batch:          per_device_train_batch_size={args.per_device_train_batch_size}, "
                 f"gradient_accumulation_steps={args.gradient_accumulation_steps}, "
                 f"steps_per_generation={args.steps_per_generation}, num_generations={args.num_generations}, "
                 f"num_iterations={args.num_iterations}")
    lines = [
        f"model:          {model_args.model_name_or_path}",
        f"dataset:        {script_args.dataset_name or [d.path for d in (dataset_args.datasets or [])]}",
        f"reward_funcs:   {script_args.reward_funcs}",
        loss,
        batch,
        f"peft:           {'LoRA r=%s targets=%s' % (model_args.lora_r, model_args.lora_target_modules) if model_args.use_peft else 'off'}",
        f"output_dir:     {args.output_dir}",
        f"accelerate:     {' '.join(launch_args) or '(defaults)'}",
    ]
    if script_args.trainer == "async":  # LUSPO clips GSPO's sequence ratio there, with GSPO's band
        from ..async_trainer.config import SEQUENCE_BAND_LOSS_TYPES as band_loss_types
    else:
        band_loss_types = GSPO_LOSS_TYPES
    banded = args.loss_type in band_loss_types
    if banded:
        lines.insert(4, f"clip band:      {band_description(args)}")
    presets = getattr(args, "paper_presets", None) or getattr(args, "presets", None) or {}
    if presets:  # the fields the recipe left unset that the config filled
        lines.insert(5 if banded else 4,
                     f"filled in:      {', '.join(f'{name}={value}' for name, value in presets.items())} "
                     "(unset in the recipe: the config's defaults for this loss type)")
    if script_args.sft_steps:
        lines.insert(3, f"sft cold start: {script_args.sft_steps} steps at lr {script_args.sft_learning_rate}")
    if script_args.tools or script_args.environment_factory:
        environment, credit = script_args.environment_factory, script_args.failed_tool_credit
        lines.insert(3, f"tools:          {script_args.tools or []}"
                        f"{f', environment_factory={environment}' if environment else ''}"
                        f", max_tool_calling_iterations={args.max_tool_calling_iterations}"
                        f"{f', failed_tool_credit={credit} (ToolCreditGSPOTrainer)' if credit is not None else ''}")
    return "\n".join(lines)


def _check_builtin_dataset(name: str) -> None:
    if name[len(BUILTIN_PREFIX):] not in BUILTIN_DATASETS:
        raise RecipeError(f"`dataset_name`: unknown built-in {name!r}"
                          f"{did_you_mean(name, [BUILTIN_PREFIX + d for d in BUILTIN_DATASETS])}. Fix: use one of "
                          f"{[BUILTIN_PREFIX + d for d in BUILTIN_DATASETS]}.")


def load_dataset(script_args, dataset_args):
    """The dataset as `trl grpo` loads it (a `DatasetMixtureConfig` through TRL's `get_dataset`, else
    `datasets.load_dataset(dataset_name)`), plus the built-in `builtin:addition`."""
    name = script_args.dataset_name
    if name and name.startswith(BUILTIN_PREFIX):
        from datasets import DatasetDict

        from ..quickstart import addition

        _check_builtin_dataset(name)
        if name == BUILTIN_PREFIX + "tool_addition":
            from ..quickstart.tools import make_tool_rl_dataset as make_rl_dataset
        else:
            make_rl_dataset = addition.make_rl_dataset
        return DatasetDict({
            script_args.dataset_train_split: make_rl_dataset(script_args.builtin_num_examples, seed=0),
            script_args.dataset_test_split: make_rl_dataset(256, seed=1),
        })
    if dataset_args.datasets:
        from trl import get_dataset

        return get_dataset(dataset_args)
    if name:
        import datasets

        return datasets.load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    raise RecipeError("no dataset: set `dataset_name` (e.g. builtin:addition or a hub id) or `datasets`.")


def launch_options(launch_args: list[str]):
    """The parsed `accelerate launch` options, and the accelerate config file they name (a dict, maybe empty)."""
    from accelerate.commands.launch import launch_command_parser

    options = launch_command_parser().parse_args(launch_args + ["--module", "trl_gspo.launch.train"])
    config = {}
    if options.config_file and os.path.isfile(options.config_file):
        import yaml

        with open(options.config_file) as handle:
            config = yaml.safe_load(handle) or {}
    return options, config


def launcher_type(launch_args: list[str]) -> str:
    """The `distributed_type` the `accelerate launch` options select: DEEPSPEED, FSDP, MULTI_GPU, NO, ..."""
    options, config = launch_options(launch_args)
    if options.use_deepspeed:
        return "DEEPSPEED"
    if options.use_fsdp:
        return "FSDP"
    return str(config.get("distributed_type", "NO")).upper()


def launched_processes(launch_args: list[str]) -> int:
    """How many training processes the launch options start (over all machines)."""
    options, config = launch_options(launch_args)
    return int(options.num_processes or config.get("num_processes") or 1)


def launched_machines(launch_args: list[str]) -> int:
    """How many machines (nodes) the launch options span."""
    options, config = launch_options(launch_args)
    return int(options.num_machines or config.get("num_machines") or 1)


def cold_start_before_launch(script_args, model_args, launch_args: list[str]) -> bool:
    """Whether `trl-gspo` runs the built-in SFT cold start in one process before launching: a DeepSpeed launch (whose
    processes cannot run a second, SFT, DeepSpeed Accelerator) or an FSDP launch (whose SFT trainer would shard the
    model it must save) of a `builtin:` model with `sft_steps > 0`."""
    return (script_args.sft_steps > 0 and (model_args.model_name_or_path or "").startswith(BUILTIN_PREFIX)
            and launcher_type(launch_args) in COLD_START_LAUNCHERS)
