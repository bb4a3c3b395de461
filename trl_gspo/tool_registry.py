"""Tools and environments named in a recipe, for TRL's tool loop (`GRPOTrainer(tools=..., environment_factory=...)`).

`tools: [add]` names functions the model may call; `environment_factory: CalculatorEnv` names a class TRL builds one
instance of per rollout (its public methods other than `reset` are the tools). A name is a built-in one (the
calculator task of `trl_gspo/quickstart/tools.py`) or a dotted path `module.attribute` (a module next to where the
command runs is found, as for `reward_funcs`). Imports no trainer; raises `RecipeError` naming the key and the fix.
"""

from __future__ import annotations

import inspect

from .recipe import RecipeError
from .rewards import import_named


def tool_registry() -> dict:
    """Name -> function, for every name `tools` accepts without a dotted path."""
    from .quickstart import tools

    return {"add": tools.add}


def environment_registry() -> dict:
    """Name -> class, for every name `environment_factory` accepts without a dotted path."""
    from .quickstart import tools

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
                raise RecipeError(f"`tools`: unknown tool {name!r}. Fix: use one of {sorted(registry)} or a dotted "
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
            raise RecipeError(f"`environment_factory`: unknown environment {name!r}. Fix: use one of "
                              f"{sorted(registry)} or a dotted path `module.Class` (a class with a `reset` method).")
    return kwargs
