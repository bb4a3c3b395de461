"""Moved to `trl_gspo.launch.multinode`; this old path is that same module object (patching either patches both)."""

import sys
from importlib import import_module

_MOVED_TO = "trl_gspo.launch.multinode"
sys.modules[__name__] = import_module(_MOVED_TO)
