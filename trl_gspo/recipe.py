"""Moved and split: parsing to `trl_gspo.launch.recipe`, the checks to `trl_gspo.launch.checks`; this old path
imports every name from either. Patch the real module (e.g. `trl_gspo.launch.checks.has_accelerator`): setting an
attribute here reaches neither."""

from importlib import import_module

_MOVED_TO = ("trl_gspo.launch.recipe", "trl_gspo.launch.checks")


def __getattr__(name):
    for module_name in _MOVED_TO:
        module = import_module(module_name)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'trl_gspo.recipe' has no attribute {name!r}")
