"""Moved to `trl_gspo.launch.train`; this old path is that same module object (patching either patches both)."""

import sys
from importlib import import_module

_MOVED_TO = "trl_gspo.launch.train"

if __name__ == "__main__":  # `python -m trl_gspo.train` (also under `accelerate launch -m`) runs the moved module
    raise SystemExit(import_module(_MOVED_TO).main())

sys.modules[__name__] = import_module(_MOVED_TO)
