"""Supervised cold start with TRL's ``SFTTrainer`` on CPU.

A few hundred steps of SFT on the synthetic task take the randomly initialised tiny model to
*partial* competence, which is what RL needs: a policy that sometimes gets the reward, so that
the group-relative advantages are not all zero.
"""

from __future__ import annotations

import os
from typing import Any

from datasets import Dataset
from datasets.utils import logging as datasets_logging
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl import SFTConfig, SFTTrainer

from .addition import make_sft_dataset


def sft_cold_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: str,
    max_steps: int = 300,
    seed: int = 0,
    *,
    dataset: Dataset | None = None,
    learning_rate: float = 3e-3,
    per_device_train_batch_size: int = 64,
    warmup_steps: int = 20,
    logging_steps: int = 50,
    router_aux_loss_coef: float | None = None,
    disable_tqdm: bool = True,
    **config_overrides: Any,
) -> PreTrainedModel:
    """Train ``model`` for ``max_steps`` supervised steps on prompt-completion pairs and return it.

    Runs in float32 on CPU unless ``use_cpu=False`` is passed (then where accelerate puts it), logs nowhere (``report_to="none"``) and saves no checkpoint (the
    caller decides what to save). ``dataset`` defaults to ``make_sft_dataset`` with enough
    examples for one pass (``max_steps * per_device_train_batch_size``). Extra keyword arguments
    override fields of the ``SFTConfig``. The training log stays available on
    ``model._sft_log_history`` (list of dicts, as ``trainer.state.log_history``).
    """
    # The SFT arguments reset and rebuild accelerate's process-wide state (a singleton) for their own device; a
    # trainer built afterwards would inherit it (a GPU run after a CPU cold start stayed on CPU). Put it back after.
    saved_process_state = _snapshot_accelerate_state()
    if dataset is None:
        dataset = make_sft_dataset(max(max_steps * per_device_train_batch_size, 1), seed=seed + 10_000)
    args = SFTConfig(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=1,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=warmup_steps,
        weight_decay=0.0,
        logging_steps=logging_steps,
        save_strategy="no",
        report_to="none",
        use_cpu=config_overrides.pop("use_cpu", True),  # CPU unless the caller asks for an accelerator
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        # Under DDP: the built-in models use every weight in every forward (each layer's experts are one fused
        # tensor), so DDP's search for unused parameters (transformers' default without checkpointing) only costs.
        ddp_find_unused_parameters=config_overrides.pop("ddp_find_unused_parameters", False),
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        completion_only_loss=True,
        packing=False,
        router_aux_loss_coef=router_aux_loss_coef,
        disable_tqdm=disable_tqdm,
        **config_overrides,
    )
    # SFTTrainer switches `output_router_logits` on in the model config (for the MoE auxiliary loss)
    # and leaves it on; cached generation then fails in the load-balancing loss, so restore it.
    text_config = model.config.get_text_config()
    saved_router_flags = {
        k: getattr(text_config, k) for k in ("output_router_logits", "router_aux_loss_coef") if hasattr(text_config, k)
    }
    bars_were_enabled = datasets_logging.is_progress_bar_enabled()
    if disable_tqdm:  # also silence the "Tokenizing train dataset" bars of the dataset preparation
        datasets_logging.disable_progress_bar()
    try:
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
    finally:
        if bars_were_enabled:
            datasets_logging.enable_progress_bar()
        for k, v in saved_router_flags.items():
            setattr(text_config, k, v)
        _restore_accelerate_state(saved_process_state)
    model = trainer.model
    model._sft_log_history = list(trainer.state.log_history)
    return model



def _accelerate_singletons():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return PartialState._shared_state, AcceleratorState._shared_state, GradientState._shared_state


def _snapshot_accelerate_state() -> tuple:
    """accelerate's process-wide state (its three singletons) and the ACCELERATE_* environment variables."""
    environment = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    return [dict(shared) for shared in _accelerate_singletons()], environment


def _restore_accelerate_state(saved: tuple) -> None:
    states, environment = saved
    for shared, values in zip(_accelerate_singletons(), states):
        shared.clear()
        shared.update(values)
    for key in [k for k in os.environ if k.startswith("ACCELERATE_") and k not in environment]:
        del os.environ[key]
    os.environ.update(environment)
