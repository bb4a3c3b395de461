"""Moved to `trl_gspo.launch.cli`; this old path is that same module object (patching either patches both)."""

import sys
from importlib import import_module

_MOVED_TO = "trl_gspo.launch.cli"

if __name__ == "__main__":  # `python -m trl_gspo.cli` runs the moved module
    raise SystemExit(import_module(_MOVED_TO).main())

sys.modules[__name__] = import_module(_MOVED_TO)
