"""Tools and environments named in a recipe, for TRL's tool loop (`GRPOTrainer(tools=..., environment_factory=...)`).

`tools: [add]` names functions the model may call; `environment_factory: CalculatorEnv` names a class TRL builds one
instance of per rollout (its public methods other than `reset` are the tools). A name is a built-in one (the
calculator task of `trl_gspo/quickstart/tools.py`) or a dotted path `module.attribute` (a module next to where the
command runs is found, as for `reward_funcs`). Imports no trainer; raises `RecipeError` naming the key and the fix.

Two checks of what TRL 1.16 would otherwise do silently: a tool name given twice (`resolve_tools` refuses it) and a
`max_completion_length` too short for a failed call's error result (`tool_budget_warning`).
"""

from __future__ import annotations

import inspect
import json
import math

from ..config import did_you_mean
from .recipe import RecipeError
from .rewards import import_named


def tool_registry() -> dict:
    """Name -> function, for every name `tools` accepts without a dotted path."""
    from ..quickstart import tools

    return {"add": tools.add}


def environment_registry() -> dict:
    """Name -> class, for every name `environment_factory` accepts without a dotted path."""
    from ..quickstart import tools

    return {"CalculatorEnv": tools.CalculatorEnv}


def resolve_tools(script_args) -> dict:
    """The keyword arguments of the trainer for the recipe's `tools` and `environment_factory`: `{}` without them,
    else `tools=[callables]` and/or `environment_factory=class`."""
    kwargs = {}
    names = script_args.tools
    if names:
        if isinstance(names, str):
            raise RecipeError(f"`tools` must be a list, got the string {names!r}. Fix: write `tools: [{names}]`.")
        registry = tool_registry()
        tools = []
        for name in names:
            if name in registry:
                tools.append(registry[name])
            elif "." in name:
                tools.append(import_named("tools", name, "function", callable))
            else:
                raise RecipeError(f"`tools`: unknown tool {name!r}{did_you_mean(name, registry)}. Fix: use one of "
                                  f"{sorted(registry)} or a dotted "
                                  "path `module.function` (a typed function with a docstring, as TRL requires).")
        kwargs["tools"] = tools
    name = script_args.environment_factory
    if name:
        registry = environment_registry()
        if name in registry:
            kwargs["environment_factory"] = registry[name]
        elif "." in name:
            kwargs["environment_factory"] = import_named("environment_factory", name, "class", inspect.isclass)
        else:
            raise RecipeError(f"`environment_factory`: unknown environment {name!r}{did_you_mean(name, registry)}. "
                              "Fix: use one of "
                              f"{sorted(registry)} or a dotted path `module.Class` (a class with a `reset` method).")
    _refuse_duplicate_names(script_args, kwargs)
    return kwargs


def environment_methods(environment: type) -> list:
    """The methods of an environment class TRL 1.16 exposes as tools: its public functions besides `reset` and
    `get_reward` (read from `GRPOTrainer.__init__`; listed on the class, as TRL does, so no instance is built)."""
    return [function for name, function in inspect.getmembers(environment, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def _refuse_duplicate_names(script_args, kwargs: dict) -> None:
    """Refuse two tools with one name. TRL 1.16 calls a tool through a dict keyed by `__name__` (`_sync_tool_dicts`,
    the `tools` functions first, then the environment's methods), so the later one silently shadows the earlier one
    in every call, while the prompt still lists the name twice."""
    sources = []  # (name TRL calls it by, where the recipe gave it)
    for entry, function in zip(script_args.tools or [], kwargs.get("tools", [])):
        sources.append((function.__name__, f"`tools` entry {entry!r}"))
    environment = kwargs.get("environment_factory")
    for method in environment_methods(environment) if environment is not None else []:
        sources.append((method.__name__, f"`environment_factory: {script_args.environment_factory}` (its method "
                                         f"{method.__name__})"))
    seen = {}
    for name, source in sources:
        if name not in seen:
            seen[name] = source
            continue
        shadowed = "the environment's method" if source.startswith("`environment_factory") else f"the later {source}"
        raise RecipeError(
            f"two tools are named {name!r}: {seen[name]} and {source}. TRL 1.16 calls tools by name, so "
            f"{shadowed} would silently shadow {seen[name]} in every call (and the prompt would list {name!r} twice). "
            f"Fix: give the model each tool once: remove {name!r} from `tools`, or rename one of the functions.")


# TRL's tool loop turns an exception inside a tool into the result str({"error": str(e)}); the sample measured here is
# TRL's own text for a call of a name it has no tool for, which the quickstart's errors (e.g. "150 out of range")
# match in length. A tool's own exception message can be longer.
SAMPLE_ERROR = "Tool {name} not found."
# Sample argument values by annotation, for a sample tool call (the failed call's arguments are unknown anyway).
_SAMPLE_VALUES = {int: 12, float: 1.5, bool: True, str: "text"}
# Without a tokenizer: characters per token of JSON-like text, and tokens of role markers around a turn (rough).
_ROUGH_CHARS_PER_TOKEN = 3
_ROUGH_MARKER_TOKENS = 12  # e.g. Qwen3: <tool_call>, newlines, <|im_end|>; <|im_start|>user, <tool_response>, ...


def _sample_call(function, bound: bool) -> tuple[str, dict]:
    try:  # annotations written as strings (`from __future__ import annotations`) are evaluated
        signature = inspect.signature(function, eval_str=True)
    except Exception:
        signature = inspect.signature(function)
    parameters = list(signature.parameters.values())[1 if bound else 0:]
    arguments = {p.name: _SAMPLE_VALUES.get(p.annotation, "x") for p in parameters
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return function.__name__, arguments


def _recipe_tokenizer(model_args):
    """The recipe's tokenizer where building it is cheap: the built-in tool tokenizer, or one already on this disk
    (a local directory or the hub cache; nothing is downloaded and no remote code runs). `None` otherwise."""
    name = model_args.model_name_or_path or ""
    if name == "builtin:tiny-qwen3-moe-tools":
        from ..quickstart.tools import build_tool_tokenizer

        return build_tool_tokenizer()
    if name.startswith("builtin:"):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, revision=model_args.model_revision, local_files_only=True)
    except Exception:  # not on this disk, remote code, no tokenizer files: fall back to the rough estimate
        return None


def _measure(tokenizer, call: dict, result: dict, template_kwargs: dict) -> tuple[int, int] | None:
    """Tokens of the assistant's tool-call turn (up to its eos, where generation stops) and of what TRL appends after
    it for the result (the tool message and the next generation prompt), rendered with the chat template TRL 1.16
    uses for tools; `None` when the template does not render them as prefixes of each other."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    template = None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)

    def ids(messages, generation_prompt):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                  return_dict=False, chat_template=template, **template_kwargs))

    user = [{"role": "user", "content": "dummy"}]
    prompt, with_call = ids(user, True), ids(user + [call], False)
    eos = [i for i, token in enumerate(with_call) if token == tokenizer.eos_token_id]
    with_call = with_call[: eos[-1] + 1] if eos else with_call
    full = ids(user + [call, result], True)
    if with_call[: len(prompt)] != prompt or full[: len(with_call)] != with_call:
        return None
    return len(with_call) - len(prompt), len(full) - len(with_call)


def tool_budget_warning(script_args, training_args, model_args, kwargs: dict,
                        unchecked: list | None = None) -> str | None:
    """A warning when `max_completion_length` is too short to keep a failed call's error result, else `None`.

    TRL 1.16's `_tool_call_loop` drops a tool result that would take the completion (the call turn plus the result)
    past `max_completion_length`: it rolls the sample back and the sample leaves the loop, with no log line. A failed
    call's result is `str({"error": str(e)})`; its size depends on the exception, so it is measured on a sample
    (`SAMPLE_ERROR`) with the recipe's tokenizer and chat template where that is cheap, else estimated from characters.
    A hub model's tokenizer that is not on this disk is then appended to `unchecked` (a dry run's list), if given.
    """
    functions = [(function, False) for function in kwargs.get("tools", [])]
    if kwargs.get("environment_factory") is not None:
        functions += [(method, True) for method in environment_methods(kwargs["environment_factory"])]
    limit = training_args.max_completion_length
    if not functions or limit is None:
        return None
    tokenizer = _recipe_tokenizer(model_args)
    if tokenizer is None and unchecked is not None and not (model_args.model_name_or_path or "").startswith("builtin:"):
        unchecked.append(("tokenizer", (f"{model_args.model_name_or_path}'s, not on this disk: whether its chat "
                                        "template renders tool calls; the tool budget is estimated from characters")))
    template_kwargs = training_args.chat_template_kwargs or {}
    if isinstance(template_kwargs, str):  # a JSON string from the command line
        template_kwargs = json.loads(template_kwargs)
    worst = None  # (call + result tokens, call tokens, result tokens, call, error text, measured)
    for function, bound in functions:
        name, arguments = _sample_call(function, bound)
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}
        error = str({"error": SAMPLE_ERROR.format(name=name)})
        sizes = None
        if tokenizer is not None:
            try:
                sizes = _measure(tokenizer, call, {"role": "tool", "name": name, "content": error}, template_kwargs)
            except Exception:  # a template that cannot render tool calls: the rough estimate below
                sizes = None
        measured = sizes is not None
        if not measured:
            call_chars = len(json.dumps({"name": name, "arguments": arguments}))
            sizes = tuple(math.ceil(chars / _ROUGH_CHARS_PER_TOKEN) + _ROUGH_MARKER_TOKENS
                          for chars in (call_chars, len(error)))
        candidate = (sum(sizes), *sizes, json.dumps({"name": name, "arguments": arguments}), error, measured)
        worst = max(worst or candidate, candidate)
    needed, call_tokens, error_tokens, call_text, error, measured = worst
    if needed <= limit:
        return None
    how = ("with the recipe's tokenizer and chat template" if measured else
           f"by a rough estimate (no tokenizer on this disk; about {_ROUGH_CHARS_PER_TOKEN} characters a token)")
    left = limit - call_tokens
    leaves = (f"leaves {left} tokens for a tool result after a sample call {call_text} ({call_tokens} tokens)"
              if left >= 0 else f"is shorter than a sample call {call_text} ({call_tokens} tokens), which is cut "
                                "before it can be parsed as a call")
    return (f"`max_completion_length` {limit} {leaves}, and a failed call's error result, e.g. {error}, is about "
            f"{error_tokens} tokens {how}; a tool's own exception text may be longer. TRL's tool loop silently drops "
            "a result that does not fit (the sample leaves the loop without it), so the model never sees its failed "
            f"calls' errors. Fix: raise max_completion_length to at least {needed}, plus the "
            "tokens of the answer after the result.")
