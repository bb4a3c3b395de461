"""The asynchronous trainer: `AsyncGSPOTrainer` (TRL's `AsyncGRPOTrainer` with GSPO's loss) and its parts.

    trainer.py   `AsyncGSPOTrainer`: the loss on TRL's packed rows, weighting per optimizer step, metrics
    config.py    `AsyncGSPOConfig`, loadable without any training code (reading a recipe loads only this)
    routing.py   R3 from a vLLM server: routes through TRL's rollout worker into the packed rows

Both names load on first use.
"""

import warnings
from importlib import import_module

from trl.import_utils import TRLExperimentalWarning

# TRL warns once, at the first import of `trl.experimental`, that its APIs may change in any release. trl-gspo pins
# the TRL release and tests each internal it uses (docs/trl_contract.md), so the notice, raised from this package's
# modules, is not one a user can act on: `trl.experimental` is imported here first, without it.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=TRLExperimentalWarning)
    import trl.experimental  # noqa: F401

__all__ = ["AsyncGSPOConfig", "AsyncGSPOTrainer"]
_HOMES = {"AsyncGSPOConfig": ".config", "AsyncGSPOTrainer": ".trainer"}


def __getattr__(name):
    if name in _HOMES:
        return getattr(import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
