"""Moved to `trl_gspo.launch.rewards`; this old path is that same module object (patching either patches both)."""

import sys
from importlib import import_module

_MOVED_TO = "trl_gspo.launch.rewards"
sys.modules[__name__] = import_module(_MOVED_TO)
