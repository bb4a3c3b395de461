"""trl-gspo: Group Sequence Policy Optimization (GSPO, arXiv 2507.18071) for Hugging Face TRL.

`trl_gspo.losses` is pure torch and imports nothing from TRL; `GSPOConfig` and `GSPOTrainer` are loaded lazily.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "AsyncGSPOConfig": "trl_gspo.async_trainer.config",
    "AsyncGSPOTrainer": "trl_gspo.async_trainer.trainer",
    "GSPOConfig": "trl_gspo.config",
    "GSPOTrainer": "trl_gspo.trainer.gspo_trainer",
    "gspo_loss": "trl_gspo.losses",
    "gspo_token_loss": "trl_gspo.losses",
    "sequence_log_ratio": "trl_gspo.losses",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_gspo' has no attribute {name!r}")
