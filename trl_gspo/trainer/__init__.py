"""The synchronous trainer: `GSPOTrainer` (TRL's `GRPOTrainer` with GSPO's loss) and the parts it wires into TRL.

    gspo_trainer.py   `GSPOTrainer`: the loss, its metrics and the hooks into TRL's rollout and training step
    routing.py        MoE routing replay (R2, R3) at the trainer's passes, and the `routing/*` metrics
    lora.py           LoRA adapters folded for rollouts and vLLM weight syncs without writing the frozen base
    trl_options.py    TRL's loss options (masks, importance-sampling correction, KL) applied to the gspo loss
    model_checks.py   construction-time checks of the model's configuration
    tool_lockstep.py  TRL's tool loop on several processes: every rank takes part in every tool turn

`GSPOTrainer` loads on first use, so importing a part does not load the whole trainer.
"""

from importlib import import_module

__all__ = ["GSPOTrainer"]


def __getattr__(name):
    if name == "GSPOTrainer":
        return import_module(".gspo_trainer", __name__).GSPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
