"""Reward functions named in a recipe: the built-in tasks', TRL's reward registry (`trl.rewards`), dotted paths.

`reward_funcs` resolves as in `trl grpo`: every reward function `trl.rewards` exports by name (read from its
`__all__`, so a TRL release that adds one makes it available here), `get_soft_overlong_punishment` with the values
`trl grpo` uses, or `module.function`. Imports no trainer; raises `RecipeError` naming the key and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys

from ..config import did_you_mean
from .recipe import RecipeError

# TRL's factories build a reward from arguments; `trl grpo` registers this one with these values.
TRL_FACTORY_DEFAULTS = {"get_soft_overlong_punishment": dict(max_completion_len=1280, soft_punish_cache=256)}
# TRL rewards that check answers with math-verify (an optional dependency).
NEEDS_MATH_VERIFY = ("accuracy_reward", "reasoning_accuracy_reward")


def reward_registry() -> dict:
    """Name -> reward callable, for every name `reward_funcs` accepts without a dotted path."""
    import trl.rewards

    from ..quickstart import addition, tools

    registry = {"digit_match_reward": addition.digit_match_reward, "exact_match_reward": addition.exact_match_reward,
                "tool_answer_reward": tools.tool_answer_reward}
    for name in trl.rewards.__all__:
        value = getattr(trl.rewards, name)
        if not inspect.isfunction(value):
            continue  # a submodule
        if name in TRL_FACTORY_DEFAULTS:
            registry[name] = value(**TRL_FACTORY_DEFAULTS[name])
        elif not name.startswith("get_"):
            registry[name] = value
    return registry


def _factories() -> list[str]:
    import trl.rewards

    return [name for name in trl.rewards.__all__
            if name.startswith("get_") and name not in TRL_FACTORY_DEFAULTS and hasattr(trl.rewards, name)]


def resolve_rewards(script_args) -> list:
    """The reward callables (and reward model path) of `script_args.reward_funcs` / `reward_model_name_or_path`."""
    names = script_args.reward_funcs
    if isinstance(names, str):
        raise RecipeError(f"`reward_funcs` must be a list, got the string {names!r}. Fix: write "
                          f"`reward_funcs: [{names}]`.")
    registry = reward_registry()
    rewards = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in names or []:
        if name in NEEDS_MATH_VERIFY and importlib.util.find_spec("math_verify") is None:
            raise RecipeError(f"`reward_funcs`: {name} checks answers with math-verify, which is not installed. "
                              'Fix: pip install -e ".[math]" in the trl-gspo checkout.')
        if name in registry:
            rewards.append(registry[name])
        elif name in _factories():
            raise RecipeError(f"`reward_funcs`: {name} is TRL's factory of a reward, it needs arguments. Fix: in "
                              f"your module, `my_reward = {name}(...)`, then name it `reward_funcs: [module.my_reward]`.")
        elif "." in name:
            rewards.append(import_named("reward_funcs", name, "function", callable,
                                        "name a function `f(completions, **kwargs) -> list[float]`"))
        else:
            raise RecipeError(f"`reward_funcs`: unknown reward {name!r}{did_you_mean(name, registry)}. Fix: use one "
                              f"of {sorted(registry)} or a "
                              "dotted path `module.function`.")
    if not rewards:
        raise RecipeError("no reward: set `reward_funcs` (e.g. [digit_match_reward]) or `reward_model_name_or_path`.")
    return rewards


def import_named(key: str, path: str, kind: str, check, fix: str | None = None):
    """The attribute a recipe's dotted `module.attribute` path names (for `reward_funcs`, `tools`,
    `environment_factory`); a module next to where the command runs is found, as `trl grpo` finds it. Raises
    `RecipeError` naming `key` when it cannot be imported or `check(value)` fails (`fix`: what to name instead)."""
    module_name, attribute = path.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise RecipeError(f"`{key}`: cannot import {path!r} ({err}). Fix: give an importable `module.{kind}` "
                          "path.") from None
    if not check(value):
        raise RecipeError(f"`{key}`: {path!r} is a {type(value).__name__}, not a {kind}. Fix: "
                          f"{fix or f'name a {kind}'}.")
    return value
