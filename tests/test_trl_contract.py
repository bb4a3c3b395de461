"""The TRL and transformers internals trl-gspo relies on, one test each (see docs/trl_contract.md).

A TRL or transformers release that renames, moves or changes one of them fails here, with the internal named in
the test, instead of silently changing what GSPOTrainer or AsyncGSPOTrainer computes. Everything is checked against
the installed versions, by signature where a signature is the contract and by running it where behaviour is.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import inspect
import math
import queue
import re
import types
import typing

from support import async_stand_ins
import numpy as np
import pytest
import torch
from support.async_stand_ins import NoWeightTransfer, QueueWorker
from support.helpers import digit_reward, tiny_config, toy_dataset
from transformers import Trainer, TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.config import (
    GSPO_CONFIG_FIELDS,
    GSPO_LOSS_FIELDS,
    NON_LOSS_FIELDS,
    OTHER_LOSS_TYPE_FIELDS,
    TRL_LOSS_TYPES,
)
from trl_gspo.quickstart.model import build_dense_model
from trl_gspo.trainer.gspo_trainer import _FORWARD_BATCH_KEYS, runs_old_policy_pass


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tokenizer):
    """A tiny off-policy TRL trainer (dense model: the contract is about TRL, not MoE)."""
    cfg = tiny_config(tmp_path_factory.mktemp("contract"), config_cls=GRPOConfig, loss_type="grpo",
                      per_device_train_batch_size=4, steps_per_generation=2)
    built = GRPOTrainer(build_dense_model(tokenizer, seed=0), digit_reward, args=cfg, train_dataset=toy_dataset(),
                        processing_class=tokenizer)
    built.model.train()
    return built


def _generation_batch(trainer):
    data = toy_dataset()
    size = trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
    return [data[i // trainer.num_generations] for i in range(size)]


# --------------------------------------------------------------------------- methods GSPOTrainer overrides or calls
def test_get_per_token_logps_and_entropies_signature_and_return():
    """GSPOTrainer calls it positionally for the first four arguments, by keyword for the rest, forwards every other
    argument from the batch dict (`_FORWARD_BATCH_KEYS`), and unpacks three results."""
    params = _parameters(GRPOTrainer._get_per_token_logps_and_entropies)
    assert params[:8] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                          "compute_entropy", "compute_aux_loss"]
    assert tuple(params[8:]) == _FORWARD_BATCH_KEYS
    signature = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)
    assert all(signature.parameters[name].default is None for name in _FORWARD_BATCH_KEYS)


def test_get_per_token_logps_and_entropies_returns_logps_entropies_aux(trainer):
    ids = torch.randint(4, 50, (3, 7))
    logps, entropies, aux = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, torch.ones_like(ids), 4, compute_entropy=True, compute_aux_loss=False)
    assert logps.shape == entropies.shape == (3, 4) and aux is None
    assert torch.all(logps <= 0) and torch.all(entropies >= 0)


def test_generate_and_score_completions_batch_keys(trainer):
    """The batch-dict keys GSPOTrainer._compute_loss reads, with the shapes it assumes."""
    assert _parameters(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    batch = trainer._generate_and_score_completions(_generation_batch(trainer))
    n, length = batch["completion_ids"].shape
    for key in ("prompt_ids", "prompt_mask"):
        assert batch[key].shape[0] == n
    assert batch["completion_mask"].shape == (n, length)
    assert batch["advantages"].shape == (n,)  # one advantage per sequence
    assert batch["old_per_token_logps"].shape == (n, length)  # off-policy: the old-policy pass ran
    assert "num_items_in_batch" in batch
    # Read only when their feature is on: ref_per_token_logps (beta), importance_sampling_ratio and
    # sampling_per_token_logps (vLLM), tool_mask (tools). Absent here, and read with .get() or under the flag.
    assert not {"ref_per_token_logps", "importance_sampling_ratio", "tool_mask"} & set(batch)


def test_compute_loss_delegates_to__compute_loss(trainer, monkeypatch):
    """GSPOTrainer overrides `_compute_loss(model, inputs)` and relies on `compute_loss` calling it."""
    assert _parameters(GRPOTrainer._compute_loss) == ["self", "model", "inputs"]
    assert _parameters(GRPOTrainer.compute_loss) == ["self", "model", "inputs", "return_outputs",
                                                     "num_items_in_batch"]
    calls = []
    monkeypatch.setattr(trainer, "_compute_loss", lambda model, inputs: calls.append((model, inputs)) or 1.0)
    assert trainer.compute_loss(trainer.model, {"x": 1}) == 1.0 and calls == [(trainer.model, {"x": 1})]


def test_training_step_signature_and_micro_step_counter(trainer):
    """GSPOTrainer wraps `training_step` (routing replay stays open through backward); checkpoints save TRL's
    micro-step counter `_step` and its rollout mini-batches `_buffered_inputs`, which `_prepare_inputs` indexes."""
    assert _parameters(GRPOTrainer.training_step) == ["self", "model", "inputs", "num_items_in_batch"]
    assert _parameters(GRPOTrainer._prepare_inputs) == ["self", "generation_batch"]
    assert isinstance(trainer._step, int) and hasattr(trainer, "_buffered_inputs")
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "self._buffered_inputs[self._step % self.args.steps_per_generation]" in source


def test_get_high_entropy_mask(trainer):
    assert _parameters(GRPOTrainer.get_high_entropy_mask) == ["self", "entropies", "mask", "threshold"]
    entropies = torch.tensor([[0.1, 0.9, 0.5, 0.3]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = trainer.get_high_entropy_mask(entropies, mask, 0.5)
    assert out.dtype == torch.bool and out.tolist() == [[False, True, True, False]]


def test_get_off_policy_mask():
    assert _parameters(GRPOTrainer.get_off_policy_mask) == ["advantages", "per_token_logps",
                                                            "sampling_per_token_logps", "mask", "off_policy_threshold"]
    keep = GRPOTrainer.get_off_policy_mask(
        advantages=torch.tensor([[1.0], [-1.0], [-1.0]]), per_token_logps=torch.zeros(3, 2),
        sampling_per_token_logps=torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.0, 0.0]]), mask=torch.ones(3, 2),
        off_policy_threshold=0.1)
    assert keep.shape == (3, 1) and keep[:, 0].tolist() == [1.0, 0.0, 1.0]


def test_trainer_attributes_read_by_gspo(trainer):
    """Set by GRPOTrainer.__init__ (or train()) and read by GSPOTrainer._compute_loss and its metrics."""
    for name in ("loss_type", "epsilon_low", "epsilon_high", "beta", "off_policy_mask_threshold",
                 "top_entropy_quantile", "use_vllm", "vllm_importance_sampling_correction", "aux_loss_enabled",
                 "router_aux_loss_coef", "entropy_coef", "use_adaptive_entropy", "num_iterations", "num_generations",
                 "ref_model", "accelerator", "model"):
        assert hasattr(trainer, name), name
    # The adaptive entropy controller's state, which TRL saves in checkpoints and gspo types update.
    assert trainer._entropy_bonus_enabled is False
    assert trainer._last_world_entropy == float("inf") and trainer._entropy_window_stats is None
    assert isinstance(trainer._metrics["train"], dict)
    assert "self.current_gradient_accumulation_steps" in inspect.getsource(GRPOTrainer._compute_loss)
    assert "entropy_ctrl_state.json" in inspect.getsource(GRPOTrainer._save_checkpoint)


def test_old_policy_pass_condition(trainer):
    """`runs_old_policy_pass` (routing replay, on-policy warnings) predicts whether TRL computes
    `old_per_token_logps`: only when a rollout batch outlives one optimizer step (or for vLLM IS correction)."""
    args = trainer.args
    saved = args.gradient_accumulation_steps, args.steps_per_generation, trainer.num_iterations
    cases = [(1, 2, 1), (2, 2, 1), (2, 1, 1), (1, 1, 2), (4, 2, 1)]
    try:
        for accumulation, steps, iterations in cases:
            args.gradient_accumulation_steps, args.steps_per_generation = accumulation, steps
            trainer.num_iterations = args.num_iterations = iterations
            batch = trainer._generate_and_score_completions(_generation_batch(trainer))
            expected = runs_old_policy_pass(args)
            assert ("old_per_token_logps" in batch) == expected, (accumulation, steps, iterations)
    finally:
        args.gradient_accumulation_steps, args.steps_per_generation, trainer.num_iterations = saved
        args.num_iterations = saved[2]
    assert [runs_old_policy_pass(_Args(*case)) for case in cases] == [True, False, False, True, False]


@dataclasses.dataclass
class _Args:
    gradient_accumulation_steps: int
    steps_per_generation: int
    num_iterations: int
    use_vllm: bool = False
    vllm_importance_sampling_correction: bool = False


def test_log_prob_pass_order_and_identity(tmp_path, tokenizer, monkeypatch):
    """In a generation round TRL scores the old policy first (with the policy model), then the reference model, and
    stores the old-policy pass's tensor itself as `old_per_token_logps`: routing replay identifies that pass by
    this identity."""
    path = tmp_path / "base"
    build_dense_model(tokenizer, seed=0).save_pretrained(path)  # TRL loads the reference model from a path
    cfg = tiny_config(tmp_path / "o", config_cls=GRPOConfig, loss_type="grpo", beta=0.1,
                      per_device_train_batch_size=4, steps_per_generation=2)
    built = GRPOTrainer(str(path), digit_reward, args=cfg, train_dataset=toy_dataset(), processing_class=tokenizer)
    built.model.train()
    calls = []
    original = built._get_per_token_logps_and_entropies

    def spy(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        calls.append((model, result[0]))
        return result

    monkeypatch.setattr(built, "_get_per_token_logps_and_entropies", spy)
    batch = built._generate_and_score_completions(_generation_batch(built))
    assert [model for model, _ in calls] == [built.model, built.ref_model]
    assert batch["old_per_token_logps"] is calls[0][1]
    assert batch["ref_per_token_logps"] is calls[1][1]


def test_transformers_trainer_checkpoint_internals():
    """GSPOTrainer overrides these to save/restore the rollout buffer and to resume fused MoE weights."""
    assert _parameters(Trainer._save_rng_state) == ["self", "output_dir"]
    assert _parameters(Trainer._save_checkpoint) == ["self", "model", "trial"]
    assert _parameters(Trainer._load_from_checkpoint) == ["self", "resume_from_checkpoint", "model"]
    assert _parameters(Trainer._get_output_dir) == ["self", "trial"]
    assert _parameters(Trainer.train)[:2] == ["self", "resume_from_checkpoint"]
    assert _parameters(GRPOTrainer._load_optimizer_and_scheduler) == ["self", "checkpoint"]


def test_transformers_logger_warning_once():
    from transformers.utils import logging

    logger = logging.get_logger("trl_gspo.contract")
    assert callable(logger.warning_once) and callable(logging.warning_once.cache_clear)


def test_trl_entry_points_used_by_the_launcher():
    """Public-but-internal TRL/accelerate functions the recipe launcher and reward resolution call."""
    import trl.rewards
    from accelerate.commands.launch import launch_command_parser
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser, get_dataset, get_peft_config
    from trl.cli.accelerate_config import resolve_accelerate_config_argument
    from trl.scripts.grpo import GRPOScriptArguments

    assert callable(launch_command_parser) and callable(resolve_accelerate_config_argument)
    assert callable(get_dataset) and callable(get_peft_config) and TrlParser and DatasetMixtureConfig
    assert dataclasses.is_dataclass(ModelConfig) and dataclasses.is_dataclass(GRPOScriptArguments)
    assert isinstance(trl.rewards.__all__, list | tuple) and trl.rewards.__all__


def test_accelerate_launch_parser_actions_used_for_stray_arguments():
    """recipe._stray_tokens reads `accelerate launch`'s argparse actions: `.nargs` 0 for flags, not 0 for options
    that take a value."""
    from accelerate.commands.launch import launch_command_parser

    actions = dict(launch_command_parser()._option_string_actions)
    assert actions["--multi_gpu"].nargs == 0 and actions["--use_deepspeed"].nargs == 0
    assert actions["--num_processes"].nargs != 0 and actions["--config_file"].nargs != 0


def test_accelerate_state_used_by_the_launched_process():
    """train.py asks accelerate which distributed type it got (FSDP refused when absent) and how many processes."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, parse_flag_from_env

    assert {"FSDP", "MULTI_CPU", "DEEPSPEED", "NO"} <= set(DistributedType.__members__)
    assert "cpu" in inspect.signature(PartialState.__init__).parameters
    assert parse_flag_from_env("TRL_GSPO_CONTRACT_UNSET_FLAG") is False
    state = PartialState(cpu=True)
    assert isinstance(state.num_processes, int) and isinstance(state.distributed_type, DistributedType)


def test_datasets_and_torch_probes_used_by_dry_run():
    """--dry_run probes hub datasets with `datasets.load_dataset_builder(path, name, ...).info.splits` and asks
    `torch.accelerator` whether FSDP can run."""
    import datasets

    parameters = _parameters(datasets.load_dataset_builder)
    assert parameters[:2] == ["path", "name"] and "data_files" in parameters
    assert "splits" in {f.name for f in dataclasses.fields(datasets.DatasetInfo)}
    assert isinstance(torch.accelerator.is_available(), bool)
    assert callable(torch.accelerator.current_accelerator)


def test_trl_reward_factories_we_build_exist_with_their_parameters():
    """rewards.TRL_FACTORY_DEFAULTS builds TRL's reward factories with `trl grpo`'s values."""
    import trl.rewards

    from trl_gspo.launch.rewards import TRL_FACTORY_DEFAULTS

    for name, kwargs in TRL_FACTORY_DEFAULTS.items():
        assert name in trl.rewards.__all__, name
        assert set(kwargs) <= set(_parameters(getattr(trl.rewards, name))), name


def test_tool_loop_internals_the_lockstep_relies_on():
    """trl_gspo/trainer/tool_lockstep.py overrides `_tool_call_loop` (any arguments, passed through) and
    `_generate_single_turn` (called positionally with these five arguments), reads the TP group and mode of TRL's `VLLMGeneration`, and sets
    `max_new_tokens` / `min_new_tokens` of the trainer's `generation_config` for an empty turn. In a tool turn TRL
    calls `_generate_single_turn(..., num_generations=1)` for the tool-calling samples only, and its vLLM generate
    slices results by `process_index * len(prompts)` (server) or the rank in the TP group (TP > 1): the reasons for
    the lockstep (docs/tool_turns.md)."""
    from trl.generation.vllm_generation import VLLMGeneration

    assert _parameters(GRPOTrainer._generate_single_turn) == [
        "self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"]
    assert _parameters(GRPOTrainer._tool_call_loop)[:3] == ["self", "prompts", "prompt_ids"]
    loop = inspect.getsource(GRPOTrainer._tool_call_loop)
    assert "num_generations=1" in loop and "while idxs_with_tool and iteration_num" in loop
    generate = inspect.getsource(VLLMGeneration.generate)
    assert "accelerator.process_index * len(prompts)" in generate and "tp_group" in generate
    assert "tensor_parallel_size" in inspect.getsource(VLLMGeneration.__init__)
    assert {"max_new_tokens", "min_new_tokens"} <= set(vars(__import__("transformers").GenerationConfig()))


# --------------------------------------------------------------------------- configuration
def test_trl_loss_types():
    """TRL's loss types, as its `loss_type` help lists them, are the ones GSPOTrainer hands to TRL."""
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    assert set(re.findall(r"'(\w+)'", listed)) == set(TRL_LOSS_TYPES)


def test_every_grpo_config_field_is_classified():
    """Sentinel: a field TRL adds to GRPOConfig fails here until someone decides what gspo types do with it and
    lists it in trl_gspo/config.py (GSPO_LOSS_FIELDS, OTHER_LOSS_TYPE_FIELDS or NON_LOSS_FIELDS)."""
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    listed = GSPO_LOSS_FIELDS + OTHER_LOSS_TYPE_FIELDS + NON_LOSS_FIELDS
    assert len(listed) == len(set(listed)), "a field is listed twice"
    assert own - set(listed) == set(), "new GRPOConfig field(s): classify them in trl_gspo/config.py"
    assert set(listed) - own == set(), "GRPOConfig field(s) gone: remove them from trl_gspo/config.py"
    gspo_own = {f.name for f in dataclasses.fields(GSPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert gspo_own == set(GSPO_CONFIG_FIELDS)


# transformers' TrainingArguments fields: optimizer, schedule, precision, parallelism, logging, saving. None enters
# the loss formula except gradient_accumulation_steps (TRL's "grpo" normalization, parity-tested with 1 and 2).
TRAINING_ARGUMENTS_FIELDS = frozenset("""
accelerator_config activation_checkpointing activation_checkpointing_kwargs adam_beta1 adam_beta2 adam_epsilon
auto_find_batch_size average_tokens_across_devices batch_eval_metrics bf16 bf16_full_eval data_seed
dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers
dataloader_persistent_workers dataloader_pin_memory dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers
ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph ddp_timeout debug deepspeed disable_tqdm do_eval
do_predict do_train enable_jit_checkpoint eval_accumulation_steps eval_delay eval_do_concat_batches eval_on_start
eval_steps eval_strategy eval_use_gather_object fp16 fp16_full_eval fsdp fsdp_config full_determinism
gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs greater_is_better hub_always_push
hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip include_for_metrics
include_num_input_tokens_seen label_names label_smoothing_factor learning_rate length_column_name
liger_kernel_config load_best_model_at_end local_rank log_level log_level_replica log_on_each_node
logging_first_step logging_nan_inf_filter logging_steps logging_strategy lr_scheduler_kwargs lr_scheduler_type
max_grad_norm max_steps metric_for_best_model neftune_noise_alpha num_train_epochs optim optim_args
optim_target_modules output_dir parallelism_config per_device_eval_batch_size per_device_train_batch_size
prediction_loss_only project push_to_hub remove_unused_columns report_to restore_callback_states_from_checkpoint
resume_from_checkpoint run_name save_on_each_node save_only_model save_steps save_strategy save_total_limit seed
skip_memory_metrics tf32 torch_compile torch_compile_backend torch_compile_mode torch_empty_cache_steps
trackio_bucket_id trackio_space_id trackio_static_space_id train_sampling_strategy use_cache use_cpu
use_liger_kernel warmup_steps weight_decay
""".split())


def test_every_training_arguments_field_is_known():
    """Sentinel for transformers: a new TrainingArguments field fails here until someone checks it does not enter
    the loss (or handles it) and adds it to the list above."""
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert fields - TRAINING_ARGUMENTS_FIELDS == set(), "new TrainingArguments field(s)"
    assert TRAINING_ARGUMENTS_FIELDS - fields == set(), "TrainingArguments field(s) gone"


def test_gspo_trainer_subclasses_grpo_trainer():
    assert issubclass(GSPOTrainer, GRPOTrainer) and issubclass(GSPOConfig, GRPOConfig)
    # The arguments GSPOTrainer.__init__ forwards unchanged.
    assert _parameters(GRPOTrainer.__init__)[:4] == ["self", "model", "reward_funcs", "args"]


def test_vllm_weight_sync_stream_used_by_exact_lora_merge(tokenizer):
    """`VLLMGeneration._iter_named_params()` with a PEFT model outside FSDP: looks up `model.merge_adapter` and
    `unmerge_adapter` on the model when it runs (an instance attribute replaces them), and yields each parameter's
    own storage (`param.data`) under vLLM's names, which is how `exact_sync_stream` recognises the adapted ones; PEFT's
    `LoraLayer.merged_adapters` decides its layers' merged path; `ParamWrapper.get_delta_factors` and PEFT's parameter
    proxies build the experts' `W + delta` (bit for bit the active forward: tests/test_lora_merge.py)."""
    import contextlib
    import types

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import layer as lora_layer
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_gspo.quickstart.model import build_model

    model = get_peft_model(build_model(tokenizer), LoraConfig(r=2, target_modules=["q_proj"],
                                                              target_parameters=["mlp.experts.down_proj"]))
    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.model = model
    generation._dist = types.SimpleNamespace(gather_params=lambda params: contextlib.nullcontext(), is_fsdp=False)
    calls = []
    model.merge_adapter = lambda *a, **k: calls.append("merge")
    model.unmerge_adapter = lambda *a, **k: calls.append("unmerge")
    storages = {param.data_ptr() for param in model.parameters()}
    streamed = list(generation._iter_named_params())
    assert calls == ["merge", "unmerge"]
    assert streamed and all(tensor.data_ptr() in storages for _, tensor in streamed)
    assert "model.layers.0.mlp.experts.down_proj" in dict(streamed)
    layers = [m for m in model.modules() if isinstance(m, lora_layer.LoraLayer)]
    assert all(m.merged_adapters == [] for m in layers)
    experts = next(m for m in layers if isinstance(m, lora_layer.ParamWrapper))
    assert len(experts.get_delta_factors("default")) == 3
    assert callable(lora_layer._LoraFactorsProxy) and callable(lora_layer._LoraParameterProxy)


def test_vllm_server_sync_walks_the_stream_for_metadata_first_and_non_main_ranks_only_join():
    """`VLLMGeneration.sync_weights` in server mode: the first sync walks `_iter_named_params()` once while
    `_weight_metadata` is None (names, dtypes, shapes only), then the main process sends a second walk through
    `vllm_client.update_named_params`; other ranks walk it without sending. GSPOTrainer's LoRA sync builds `W + delta`
    only for the walk that is sent (trl_gspo/trainer/lora.py)."""
    import types

    from trl.generation.vllm_generation import VLLMGeneration

    for main in (True, False):
        generation = VLLMGeneration.__new__(VLLMGeneration)
        generation.mode, generation.enable_sleep_mode, generation._weight_metadata = "server", False, None
        generation.accelerator = types.SimpleNamespace(is_main_process=main)
        walks, sent = [], []

        def walk():
            walks.append(generation._weight_metadata is None)
            yield "w", torch.zeros(2, 3)

        generation._iter_named_params = walk
        generation.vllm_client = types.SimpleNamespace(
            update_named_params=lambda metadata, stream: sent.append((metadata, [name for name, _ in stream])),
            reset_prefix_cache=lambda: None)
        for _ in range(2):
            generation.sync_weights()
        assert walks == [True, False, False], walks  # one metadata walk, then one walk per sync
        assert generation._weight_metadata == [("w", "float32", [2, 3])]
        assert sent == ([([("w", "float32", [2, 3])], ["w"])] * 2 if main else [])


# --------------------------------------------------------------------------- the asynchronous trainer
# trl_gspo/async_trainer/ (trainer.py, routing.py, config.py) and the test stand-ins build on TRL 1.16's
# `trl.experimental.async_grpo`, which TRL marks unstable. Its modules are imported inside the tests, so a release that
# moves one fails the tests that use it, by name, and leaves the pins above running.
def _async_sample(ids, mask, group_id, advantage=1.0):
    """One sample as TRL's queue reader yields it (`RolloutQueueDataset.__iter__`)."""
    return {"input_ids": np.array(ids), "completion_mask": np.array(mask),
            "old_log_probs": np.array([-0.5 * m for m in mask], dtype=np.float32), "advantage": advantage,
            "group_id": group_id, "metrics": {}}


def _tree_rows(*rows):
    from trl.experimental.async_grpo.packing import TreeRow

    built = []
    for samples in rows:
        built.append(TreeRow())
        for sample in samples:
            built[-1].add(sample)
    return built


# Two completions of one prompt that fork after two tokens, and a shorter sample of another group on a second row.
_FORKED = (_async_sample([5, 6, 7, 8], [0, 0, 1, 1], 0), _async_sample([5, 6, 9], [0, 0, 1], 0, advantage=-1.0))
_OTHER = (_async_sample([4, 3], [0, 1], 1),)

# The packed batch's keys: what AsyncGSPOTrainer.compute_loss / _packed_forward / _count_step_tokens read.
_ASYNC_BATCH_KEYS = {"input_ids", "position_ids", "shift_labels", "attention_mask", "token_index", "segment_id",
                     "old_log_probs", "advantages", "tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k",
                     "tree_max_seqlens", "global_n_tokens", "global_n_forward_tokens", "mean_seq_len"}


@pytest.fixture(scope="module")
def async_trainer(tmp_path_factory, tiny_moe_dir, tokenizer):
    """A tiny AsyncGSPOTrainer (MoE: the router auxiliary loss is part of the contract) on a queue the test fills, with
    no weight transfer and no server. TRL prices MFU from the CUDA device name at construction: None here, as TRL
    returns for an unknown device (the stand-in's seam, patched for the construction only)."""
    from trl.experimental.async_grpo import async_grpo_trainer

    from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"
    args = AsyncGSPOConfig(output_dir=str(tmp_path_factory.mktemp("async_contract")), use_cpu=True, report_to="none",
                           max_steps=1, per_device_train_batch_size=2, num_generations=2, token_budget=0,
                           save_strategy="no", disable_tqdm=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)
        return AsyncGSPOTrainer(model=str(tiny_moe_dir), reward_funcs=[], args=args, train_dataset=toy_dataset(4),
                                processing_class=tokenizer, rollout_worker=QueueWorker(),
                                weight_transfer=NoWeightTransfer())


def test_async_names_imported_from_trl():
    """Every name trl_gspo's asynchronous modules and the test stand-ins import from TRL, where they import it."""
    import trl.experimental.async_grpo as package
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing
    from trl.trainer import utils

    assert {"AsyncGRPOTrainer", "AsyncGRPOConfig"} <= set(vars(package))
    for module, names in ((async_grpo_trainer, ("AsyncRolloutWorker", "DataCollatorForRollout", "FixedCountBatcher",
                                                "RolloutQueueDataset", "TokenBudgetBatcher", "_EmptyIterableDataset",
                                                "_reduce_metric", "get_peak_flops_per_device")),
                          (async_rollout_worker, ("RolloutSample", "TrainingSequence", "RolloutGroup",
                                                  "_AsyncRolloutLoop")),
                          (packing, ("TreeRow", "_flash_attn", "tree_attention")),
                          (utils, ("pad",))):
        for name in names:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_async_trainer_init_and_hooks_signatures():
    """AsyncGSPOTrainer forwards `__init__`'s arguments positionally after `args`, calls these hooks with these
    arguments and replaces `get_train_dataloader`. TRL scales its loss for gradient accumulation itself
    (`loss_is_scaled_for_ga`), so transformers does not divide the loss AsyncGSPOTrainer returns; and transformers
    fetches all micro-batches of an optimizer step through `get_batch_samples` before training the first, which is
    where AsyncGSPOTrainer counts the step's completions."""
    from accelerate.utils import broadcast_object_list
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    assert _parameters(AsyncGRPOTrainer.__init__) == [
        "self", "model", "reward_funcs", "args", "train_dataset", "processing_class", "callbacks", "optimizers",
        "peft_config", "tools", "environment_factory", "rollout_worker", "weight_transfer"]
    assert _parameters(AsyncGRPOTrainer.get_train_dataloader) == ["self"]
    assert _parameters(AsyncGRPOTrainer._sync_weight) == ["self"]
    assert _parameters(AsyncGRPOTrainer._set_signature_columns_if_needed) == ["self"]
    assert _parameters(AsyncGRPOTrainer.training_step) == ["self", "model", "inputs", "num_items_in_batch"]
    assert _parameters(AsyncGRPOTrainer.compute_loss) == ["self", "model", "inputs", "return_outputs",
                                                          "num_items_in_batch"]
    assert AsyncGRPOTrainer.loss_is_scaled_for_ga is True
    assert _parameters(Trainer.get_batch_samples) == ["self", "epoch_iterator", "num_batches", "device"]
    loop = inspect.getsource(Trainer._run_epoch)  # one epoch of transformers' training loop
    assert "self.get_batch_samples(epoch_iterator, num_batches, self.args.device)" in loop
    assert "self.current_gradient_accumulation_steps = len(batch_samples)" in loop
    assert _parameters(broadcast_object_list)[:2] == ["object_list", "from_process"]


def test_async_trainer_attributes_read_by_async_gspo(async_trainer):
    """Set by AsyncGRPOTrainer.__init__ and read by AsyncGSPOTrainer (its dataloader, loss, step accounting and
    weight-version tracking)."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    trainer = async_trainer
    assert (trainer.epsilon_low, trainer.epsilon_high) == (trainer.args.epsilon, trainer.args.epsilon_high)
    assert "args.epsilon_high if args.epsilon_high is not None else args.epsilon" in inspect.getsource(
        AsyncGRPOTrainer.__init__)
    text_config = trainer.model.config.get_text_config()
    assert trainer.aux_loss_enabled is True and trainer.router_aux_loss_coef == text_config.router_aux_loss_coef
    assert trainer.model_version == 0 and isinstance(trainer._trained_groups, set)
    assert isinstance(trainer._metrics["train"], collections.defaultdict)
    assert trainer.rollout_worker is not None and trainer.rollout_queue is trainer.rollout_worker.rollout_buffer
    assert isinstance(trainer.vllm_client, VLLMClient)
    assert callable(VLLMClient.wait_for_server_ready) and callable(VLLMClient.get_max_model_len)
    assert hasattr(trainer, "_rollout_dataset")
    for name in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples",
                 "_step_forward_s"):
        assert getattr(trainer, name) == 0.0, name
    assert trainer.processing_class.pad_token_id is not None
    assert isinstance(AsyncGRPOTrainer._tag_names, list) and isinstance(AsyncGRPOTrainer._name, str)  # model cards


def test_async_step_accounting_flushed_by_log_step_metrics(async_trainer):
    """AsyncGSPOTrainer adds each micro-batch's counts to TRL's `_step_*` counters as TRL's loss does; TRL's
    `_log_step_metrics` turns them into its `perf/*` and `batch/*` metrics once per optimizer step and zeroes them,
    flushes the queue reader's wait (`_rollout_dataset.wait_s`) and counts the step's prompt groups from
    `_trained_groups`. MFU is skipped when the peak FLOPs are unknown (None)."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    trainer = async_trainer
    trainer.get_train_dataloader()  # sets `_rollout_dataset` (trl_gspo's reader)
    trainer._rollout_dataset.wait_s = 0.25
    trainer._trained_groups.update({0, 1, 2})
    trainer._step_forward_tokens, trainer._step_trained_tokens = 12.0, 5.0
    trainer._step_seq_len_weighted, trainer._step_samples, trainer._step_forward_s = 36.0, 4.0, 0.5
    trainer._current_train_step_time = 1.0
    metrics = trainer._metrics["train"]
    try:
        trainer._log_step_metrics()
        assert metrics["batch/forwarded_tokens_per_step"][-1] == 12.0
        assert metrics["batch/trained_tokens_per_step"][-1] == 5.0
        assert metrics["batch/samples_per_step"][-1] == 4.0 and metrics["perf/fwd_s"][-1] == 0.5
        assert metrics["perf/rollout_wait_s"][-1] == 0.25 and trainer._rollout_dataset.wait_s == 0.0
        assert metrics["batch/groups_per_step"][-1] == 3.0
        assert "perf/mfu_fwd_bwd" not in metrics and trainer._peak_flops_per_device is None
        for name in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples",
                     "_step_forward_s"):
            assert getattr(trainer, name) == 0.0, name
    finally:
        trainer._trained_groups.clear()
        trainer._last_groups_trained = 0
        metrics.clear()
    accounting = inspect.getsource(AsyncGRPOTrainer.compute_loss)
    assert "self._step_samples += n_forward_tokens / mean_seq_len" in accounting
    assert "self._step_forward_s += self._last_forward_time_s" in accounting
    assert "self._step_seq_len_weighted += mean_seq_len * n_forward_tokens" in accounting


def test_async_sync_weight_bumps_model_version(async_trainer, monkeypatch):
    """TRL's `_sync_weight` streams the weights through the injected transfer under transformers' parameter names
    (what tests/support/async_weight_files.py hands vLLM's `load_weights`) and then, on the main process only, adds one
    to `model_version` and tells the rollout worker; AsyncGSPOTrainer broadcasts that version to every rank."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    trainer = async_trainer
    told, sent = [], []
    monkeypatch.setattr(trainer.rollout_worker, "update_model_version", told.append)
    monkeypatch.setattr(trainer.weight_transfer, "send_weights",
                        lambda weights: sent.extend(name for name, _ in weights))
    try:
        AsyncGRPOTrainer._sync_weight(trainer)
        assert trainer.model_version == 1 and told == [1]
        assert sent == [name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad]
        trainer._sync_weight()
        assert trainer.model_version == 2 and trainer._policy_version == 2
    finally:
        trainer.model_version = trainer._policy_version = 0
        trainer._metrics["train"].clear()


def test_async_merged_weight_sync_methods_used_by_exact_lora_merge():
    """TRL's merged sync `_sync_weight_merged(t0)` calls `merge_adapter()` / `unmerge_adapter()` on the unwrapped
    model around `_streaming_iter()`, which yields `param.detach()` (the parameter's own storage) outside FSDP2;
    AsyncGSPOTrainer overrides both (tests/test_async_trainer.py checks the bf16 base bit for bit)."""
    import inspect

    from trl.experimental.async_grpo import AsyncGRPOTrainer

    assert _parameters(AsyncGRPOTrainer._sync_weight_merged) == ["self", "t0"]
    assert _parameters(AsyncGRPOTrainer._streaming_iter) == ["self"]
    source = inspect.getsource(AsyncGRPOTrainer._sync_weight_merged)
    assert "merge_adapter()" in source and "unmerge_adapter()" in source and "_streaming_iter()" in source
    assert "param.detach()" in inspect.getsource(AsyncGRPOTrainer._streaming_iter)


def test_async_set_signature_columns_are_the_packed_batch_keys(async_trainer):
    """TRL sets `_signature_columns` to a list of the packed batch's keys, only while it is None; AsyncGSPOTrainer
    appends its own keys to that list."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    trainer = async_trainer
    saved = trainer._signature_columns
    try:
        trainer._signature_columns = None
        AsyncGRPOTrainer._set_signature_columns_if_needed(trainer)
        assert isinstance(trainer._signature_columns, list) and set(trainer._signature_columns) == _ASYNC_BATCH_KEYS
        trainer._set_signature_columns_if_needed()
        assert {"segment_version", "global_n_sequences", "routes", "routed"} <= set(trainer._signature_columns)
    finally:
        trainer._signature_columns = saved


def test_async_dataloader_pipeline_mirrored():
    """AsyncGSPOTrainer.get_train_dataloader rebuilds TRL's pipeline (queue reader -> planner -> packer) with its own
    reader and packer: TRL's must still be that pipeline, built from these arguments."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    source = inspect.getsource(AsyncGRPOTrainer.get_train_dataloader)
    for fragment in ("RolloutQueueDataset(", "model_version_fn=lambda: self.model_version",
                     "check_health_fn=self.rollout_worker.check_health",
                     "stale_after_s=self.args.heartbeat_stale_after_s", "max_staleness=self.args.max_staleness",
                     "self._rollout_dataset = dataset", "if self.args.token_budget is None:",
                     "self.args.token_budget = self.vllm_client.get_max_model_len()",
                     "if self.args.token_budget > 0:",
                     "TokenBudgetBatcher(dataset, num_processes, self.args.token_budget, self._metrics[\"train\"])",
                     "self.args.per_device_train_batch_size * num_processes", "_EmptyIterableDataset()",
                     "batch_size=1", "groups_trained=self._trained_groups",
                     "token_budget=max(self.args.token_budget or 0, 0)", "num_workers=0"):
        assert fragment in source, fragment


def test_async_compute_loss_forward_mirrored():
    """AsyncGSPOTrainer._packed_forward calls the model as TRL's loss does: TRL's padding stripped by
    `attention_mask`, tree indices by `>= 0`, the fused LM head, router logits when the aux loss is on, and the
    per-target log-probs and entropies taken at `token_index`."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    source = inspect.getsource(AsyncGRPOTrainer.compute_loss)
    for fragment in ('inputs["input_ids"][mask_bool].unsqueeze(0)', 'selected = inputs["token_index"] >= 0',
                     "inputs[key][inputs[key] >= 0]", 'inputs["tree_max_seqlens"][0].tolist()', "fused_lm_head=True",
                     '{"output_router_logits": True} if self.aux_loss_enabled',
                     "outputs.log_probs.flatten()[token_index]", "outputs.entropy.flatten()[token_index]",
                     "self._last_forward_time_s = time.time() - forward_start",
                     "self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps"):
        assert fragment in source, fragment


def test_async_model_forward_outputs(async_trainer, monkeypatch):
    """The model TRL builds (tree attention, fused LM head, MoE) takes the packed row with the keyword arguments
    AsyncGSPOTrainer passes and returns per-position `log_probs` and `entropy` and an `aux_loss`."""
    from trl.experimental.async_grpo import packing

    monkeypatch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(
        flash_attn_varlen_func=async_stand_ins.flash_attn_varlen_func))
    collator = _async_collator()
    batch = collator([_tree_rows(_FORKED)])
    tree = {key: batch[key][0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = batch["tree_max_seqlens"][0].tolist()
    with torch.no_grad():
        outputs = async_trainer.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                      shift_labels=batch["shift_labels"], fused_lm_head=True, output_router_logits=True,
                                      **tree)
    n = batch["input_ids"].shape[1]
    assert outputs.log_probs.shape == outputs.entropy.shape == (1, n)
    trained = outputs.log_probs.flatten()[batch["token_index"][0]]
    assert torch.isfinite(trained).all() and (trained <= 0).all()
    assert (outputs.entropy.flatten()[batch["token_index"][0]] >= 0).all()
    assert outputs.aux_loss.ndim == 0 and torch.isfinite(outputs.aux_loss)


def test_async_tree_attention_seam(monkeypatch):
    """tests/support/async_stand_ins.py replaces FlashAttention-3 at `packing._flash_attn`: TRL's `tree_attention` looks
    it up there on every call and calls its `flash_attn_varlen_func` with the gathered path keys, FlashAttention's
    varlen arguments and these keywords. Through the stand-in, a forked sample's tokens attend exactly to their own
    path."""
    from trl.experimental.async_grpo import packing

    calls = []

    def recording(*args, **kwargs):
        calls.append((len(args), set(kwargs)))
        return async_stand_ins.flash_attn_varlen_func(*args, **kwargs)

    monkeypatch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=recording))
    (row,) = _tree_rows(_FORKED)
    packed = row.pack()
    n, heads, dim = len(packed["input_ids"]), 2, 4
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, n, dim, dtype=torch.float64, generator=generator) for _ in range(3))
    (max_q, max_k) = packed["tree_max_seqlens"].tolist()
    out, weights = packing.tree_attention(None, query, key, value, None, tree_kv_index=packed["tree_kv_index"],
                                          tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                                          tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlen_q=max_q,
                                          tree_max_seqlen_k=max_k, scaling=0.5)
    assert calls == [(7, {"softmax_scale", "causal", "window_size"})] and weights is None
    assert out.shape == (1, n, heads, dim)
    stand_in = set(_parameters(async_stand_ins.flash_attn_varlen_func))
    assert {"softmax_scale", "causal", "window_size", "softcap"} <= stand_in
    # The second sample's path: the shared prompt token, then its own branch, packed after the first sample's.
    order = _packed_order(row)
    positions = torch.tensor([order.index(node) for node in row.sample_nodes[1]])
    expected = torch.nn.functional.scaled_dot_product_attention(
        query[0][:, positions], key[0][:, positions], value[0][:, positions], is_causal=True, scale=0.5)
    torch.testing.assert_close(out[0, positions].transpose(0, 1), expected)
    assert "_flash_attn().flash_attn_varlen_func(" in inspect.getsource(packing.tree_attention)


def _packed_order(row):
    """The trie nodes in TRL's packed order: `TreeRow.pack` with the node ids as tokens (as trl_gspo.async_trainer.routing
    packs them)."""
    tokens, row.tokens = row.tokens, list(range(len(row.tokens)))
    try:
        return row.pack()["input_ids"].tolist()
    finally:
        row.tokens = tokens


def test_async_peak_flops_seam():
    """The other stand-in: AsyncGRPOTrainer.__init__ looks `get_peak_flops_per_device(accelerator, dtype)` up in its
    module at call time (it reads the CUDA device name); TRL itself answers None for a device it does not know, and
    then leaves MFU out."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer
    from trl.trainer.utils import get_peak_flops, get_peak_flops_per_device

    assert _parameters(get_peak_flops_per_device) == ["accelerator", "dtype"]
    assert "self._peak_flops_per_device = get_peak_flops_per_device(self.accelerator, dtype)" in inspect.getsource(
        AsyncGRPOTrainer.__init__)
    assert "torch.cuda.get_device_name" in inspect.getsource(get_peak_flops_per_device)
    assert get_peak_flops("An Accelerator TRL Does Not Know", "bfloat16") is None
    assert "if self._peak_flops_per_device is not None:" in inspect.getsource(AsyncGRPOTrainer._log_step_metrics)
    assert hasattr(async_grpo_trainer, "get_peak_flops_per_device")


def test_async_worker_and_weight_transfer_protocols():
    """The stand-ins implement TRL's `RolloutWorkerProtocol` (tests' QueueWorker) and `WeightTransferProtocol`
    (NoWeightTransfer, tests/support/async_weight_files.py's FileWeightTransfer), method by method with TRL's
    parameters; TRL takes both injected and reads the worker's `rollout_buffer` as its rollout queue."""
    from support.async_weight_files import FileWeightTransfer
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol, WeightTransferProtocol

    def methods(protocol):
        return {name: _parameters(value) for name, value in vars(protocol).items()
                if callable(value) and not name.startswith("_")}

    worker = methods(RolloutWorkerProtocol)
    assert set(worker) == {"start", "stop", "update_model_version", "check_health"}
    assert set(RolloutWorkerProtocol.__annotations__) == {"rollout_buffer", "metrics_queue"}
    queue_worker = QueueWorker()
    assert hasattr(queue_worker, "rollout_buffer") and hasattr(queue_worker, "metrics_queue")
    for name, parameters in worker.items():
        assert len(_parameters(getattr(QueueWorker, name))) == len(parameters), name
    transfer = methods(WeightTransferProtocol)
    assert set(transfer) == {"init_weight_transfer", "pause", "send_weights", "resume", "destroy"}
    for implementation in (NoWeightTransfer, FileWeightTransfer):
        for name, parameters in transfer.items():
            assert len(_parameters(getattr(implementation, name))) == len(parameters), (implementation, name)
    source = inspect.getsource(AsyncGRPOTrainer.__init__)
    assert "self.rollout_queue = self.rollout_worker.rollout_buffer" in source
    assert "self.weight_transfer = weight_transfer" in source and "self.rollout_worker = rollout_worker" in source


def test_async_rollout_queue_dataset_reader():
    """trl_gspo's reader subclasses TRL's `RolloutQueueDataset` with these keyword arguments and wraps its `queue`:
    TRL reads the queue only through `get(timeout=...)` and `qsize()`, drops a sample more than `max_staleness`
    versions behind `model_version_fn()`, and yields each kept sample (these keys) right after reading it, so the
    last sample read is the one yielded."""
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from trl_gspo.async_trainer.trainer import _RecordingQueue

    assert _parameters(RolloutQueueDataset.__init__) == [
        "self", "rollout_queue", "model_version_fn", "check_health_fn", "stale_after_s", "metrics", "max_staleness",
        "poll_interval_s", "report_to"]
    samples = [RolloutSample(prompt=[], completion=[], input_ids=np.array([1, 2, 3]),
                             completion_mask=np.array([0, 1, 1]), old_log_probs=np.zeros(3, dtype=np.float32),
                             advantage=0.5, model_version=version, group_id=version, metrics={})
               for version in (0, 2)]
    rollout_queue = queue.Queue()
    for sample in samples:
        rollout_queue.put(sample)
    recording = _RecordingQueue(rollout_queue)
    metrics = collections.defaultdict(list)
    reader = RolloutQueueDataset(recording, model_version_fn=lambda: 2, check_health_fn=lambda stale_after_s: None,
                                 stale_after_s=60.0, metrics=metrics, max_staleness=1, report_to=[])
    assert reader.queue is recording and reader.wait_s == 0.0
    item = next(iter(reader))
    assert recording.last is samples[1] and item["group_id"] == 2
    assert set(item) == {"input_ids", "completion_mask", "old_log_probs", "advantage", "group_id", "metrics"}
    assert metrics["sample/dropped_stale_total"] == [1.0]


def test_async_batchers_and_empty_dataset():
    """The planners AsyncGSPOTrainer builds, with these arguments: each yields one micro-batch as a list of
    `num_processes` non-empty `TreeRow`s; `_EmptyIterableDataset()` stands in on the other ranks."""
    from trl.experimental.async_grpo.async_grpo_trainer import (
        FixedCountBatcher,
        TokenBudgetBatcher,
        _EmptyIterableDataset,
    )
    from trl.experimental.async_grpo.packing import TreeRow

    assert _parameters(TokenBudgetBatcher.__init__) == ["self", "dataset", "num_processes", "token_budget", "metrics"]
    assert _parameters(FixedCountBatcher.__init__) == ["self", "dataset", "num_processes", "microbatch_size"]
    samples = [*_FORKED, *_OTHER, _async_sample([7, 7, 7], [0, 1, 1], 2)]
    (rows,) = list(FixedCountBatcher(samples, 2, 4))
    assert len(rows) == 2 and all(isinstance(row, TreeRow) and row.samples for row in rows)
    assert sum(len(row.samples) for row in rows) == 4
    rows = next(iter(TokenBudgetBatcher(samples, 1, 5, collections.defaultdict(list))))
    assert len(rows) == 1 and isinstance(rows[0], TreeRow) and len(rows[0].tokens) <= 5
    assert list(_EmptyIterableDataset()) == []


def test_async_tree_row_fields_and_pack():
    """trl_gspo.async_trainer.routing.packed_routes reads `TreeRow.tokens`, `sample_nodes`, `samples` and packs the node
    ids in place of the tokens to learn the packed order: `pack()` lays `tokens` out by node, so the packed `input_ids` are
    the tokens in that order. `segment_id` numbers the row's samples in `samples` order (the collator's
    `segment_version`), and each target's label sits at its `token_index`."""
    from trl.experimental.async_grpo.packing import TreeRow

    (row,) = _tree_rows(_FORKED)
    assert isinstance(row, TreeRow) and row.samples == list(_FORKED) and row.groups == {0}
    assert [len(nodes) for nodes in row.sample_nodes] == [4, 3]
    assert row.sample_nodes[0][:1] == row.sample_nodes[1][:1]  # the shared prompt token is one node
    packed = row.pack()
    assert set(packed) == _ASYNC_BATCH_KEYS - {"attention_mask", "global_n_tokens", "global_n_forward_tokens",
                                               "mean_seq_len"}
    order = _packed_order(row)
    assert sorted(order) == list(range(len(row.tokens)))
    assert [row.tokens[node] for node in order] == packed["input_ids"].tolist()
    trained = [int(sample["completion_mask"].sum()) for sample in row.samples]
    assert packed["segment_id"].tolist() == [i for i, count in enumerate(trained) for _ in range(count)]
    targets = [t for sample in row.samples for t, m in zip(sample["input_ids"], sample["completion_mask"]) if m]
    assert packed["shift_labels"][packed["token_index"]].tolist() == targets
    assert packed["advantages"].tolist() == [1.0, 1.0, -1.0]


def _async_collator(num_processes=1, **kwargs):
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

    return DataCollatorForRollout(0, num_processes, **kwargs)


def test_async_data_collator_fields_and_batch():
    """trl_gspo's packer subclasses TRL's `DataCollatorForRollout` (fields in this order, the first two given
    positionally), calls it on `[rows]` and reads the packed batch: these keys, rows padded on the right (so
    `attention_mask` strips the padding and keeps positions), -1 where a padded index must be dropped, per-rank copies
    of the micro-batch's counts. It hands TRL's `groups_trained` an object with only `update`, called once per
    micro-batch with its group ids."""
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

    assert [f.name for f in dataclasses.fields(DataCollatorForRollout)] == [
        "pad_token_id", "num_processes", "return_tensors", "groups_trained", "metrics", "token_budget"]

    class Groups:
        def __init__(self):
            self.updates = []

        def update(self, groups):
            self.updates.append(set(groups))

    groups, metrics = Groups(), collections.defaultdict(list)
    batch = _async_collator(2, groups_trained=groups, metrics=metrics, token_budget=0)([_tree_rows(_FORKED, _OTHER)])
    assert set(batch) == _ASYNC_BATCH_KEYS and groups.updates == [{0, 1}]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch["input_ids"].shape == (2, 6) and batch["tree_max_seqlens"].shape == (2, 2)
    for key in ("token_index", "tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
        assert (batch[key][1] == -1).any(), key  # the shorter row's padding
        assert (batch[key][0] >= 0).all(), key
    assert batch["global_n_tokens"].tolist() == [4.0, 4.0]
    assert batch["global_n_forward_tokens"].tolist() == [8.0, 8.0]
    assert batch["mean_seq_len"].tolist() == pytest.approx([8 / 3] * 2)
    assert metrics["batch/samples_per_row"] == [1.5]


def test_async_rollout_sample_and_training_sequence_fields():
    """RoutedRolloutSample subclasses TRL's `RolloutSample` (slots) and copies it field by field; RoutedRolloutLoop sets
    a `routes` attribute on TRL's `TrainingSequence`s, which have no slots, and reads
    `RolloutGroup.completions_sequences`."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, RolloutSample, TrainingSequence

    assert [f.name for f in dataclasses.fields(RolloutSample)] == [
        "prompt", "completion", "input_ids", "completion_mask", "old_log_probs", "advantage", "model_version",
        "group_id", "metrics", "enqueued_at"]
    assert hasattr(RolloutSample, "__slots__")
    assert [f.name for f in dataclasses.fields(TrainingSequence)] == [
        "input_ids", "completion_mask", "old_log_probs", "rollout_id"]
    sequence = TrainingSequence([1, 2], [0, 1], [0.0, -1.0], "r")
    sequence.routes = None
    assert "completions_sequences" in {f.name for f in dataclasses.fields(RolloutGroup)}


def test_async_rollout_loop_methods_routed_loop_overrides():
    """RoutedRolloutLoop overrides `_post`, `_generate_one` and `_score_group` of TRL's `_AsyncRolloutLoop` and is
    installed as `AsyncRolloutWorker._loop_cls`, which the worker's child process instantiates. Each conversation is
    its own asyncio task (the turns' context variable is per conversation), its turns go through `_post` to
    `/v1/completions` with `prompt` the turn's token ids, and `_generate_one` returns the training sequences third."""
    from trl.experimental.async_grpo.async_rollout_worker import (
        AsyncRolloutWorker,
        TrainingSequence,
        _AsyncRolloutLoop,
        _child_main,
    )

    assert _parameters(_AsyncRolloutLoop._post) == ["self", "path", "payload", "timeout", "max_retries"]
    assert inspect.signature(_AsyncRolloutLoop._post).parameters["max_retries"].default == 3
    assert _parameters(_AsyncRolloutLoop._generate_one) == ["self", "prompt", "tool_dict", "tools", "group_id"]
    assert _parameters(_AsyncRolloutLoop._score_group) == ["self", "group"]
    for name in ("_post", "_generate_one", "_score_group"):
        assert inspect.iscoroutinefunction(getattr(_AsyncRolloutLoop, name)), name
    returned = typing.get_args(inspect.signature(_AsyncRolloutLoop._generate_one).return_annotation)
    assert len(returned) == 6 and returned[2] == list[TrainingSequence]
    assert AsyncRolloutWorker._loop_cls is _AsyncRolloutLoop
    assert "self._loop_cls," in inspect.getsource(AsyncRolloutWorker.start)
    assert "rollout_loop = loop_cls(" in inspect.getsource(_child_main)
    generate = inspect.getsource(_AsyncRolloutLoop._generate_loop)
    assert re.search(r"asyncio\.create_task\(\s*self\._generate_one\(", generate)
    turn = inspect.getsource(_AsyncRolloutLoop._generate_one_turn)
    assert '"prompt": prompt_ids' in turn and 'self._post("/v1/completions", payload' in turn
    assert 'choice["token_ids"]' in turn
    assert "await self._generate_one_turn(prompt_ids)" in inspect.getsource(_AsyncRolloutLoop._generate_one)


def test_async_rollout_loop_http_call_routed_loop_replaces():
    """RoutedRolloutLoop makes `/v1/completions` calls itself (to ask for the route frame and read it), as TRL's
    `_post` does: on TRL's aiohttp `session` (opened in `_run_loops`), at `vllm_server_url` (no trailing slash) plus
    the path, the payload as JSON, inside TRL's `_retry(coro_factory, *, label, max_attempts)`, which retries
    transport errors only (a refused frame, a ValueError, is raised at once). TRL's `_generate_one_turn` reads the
    choice's `token_ids` and `logprobs.token_logprobs` from the dict `_post` returns."""
    import asyncio
    import collections

    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    retry = inspect.signature(_AsyncRolloutLoop._retry).parameters
    assert list(retry) == ["self", "coro_factory", "label", "max_attempts"]
    assert retry["label"].kind is retry["max_attempts"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.iscoroutinefunction(_AsyncRolloutLoop._retry)
    post = inspect.getsource(_AsyncRolloutLoop._post)
    assert "self.session.post(" in post and 'f"{self.vllm_server_url}{path}", json=payload' in post
    assert "self.session = session" in inspect.getsource(_AsyncRolloutLoop._run_loops)
    assert 'self.vllm_server_url = vllm_server_url.rstrip("/")' in inspect.getsource(_AsyncRolloutLoop.__init__)
    turn = inspect.getsource(_AsyncRolloutLoop._generate_one_turn)
    assert 'choice = output["choices"][0]' in turn and 'choice["logprobs"]["token_logprobs"]' in turn

    pytest.importorskip("aiohttp")  # TRL defines the retried errors only where aiohttp is installed
    loop, calls = _AsyncRolloutLoop.__new__(_AsyncRolloutLoop), []
    loop._counters = collections.Counter()

    async def refused():
        calls.append(1)
        raise ValueError("a refused route frame")

    with pytest.raises(ValueError, match="refused route frame"):
        asyncio.run(loop._retry(refused, label="POST /v1/completions", max_attempts=3))
    assert calls == [1] and not loop._counters
def test_async_score_group_keeps_sequence_order():
    """RoutedRolloutLoop pairs TRL's scored samples with the group's training sequences by position: TRL's
    `_score_group` returns one sample per sequence, conversation by conversation, in `completions_sequences` order."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, TrainingSequence, _AsyncRolloutLoop

    conversations = [[TrainingSequence([1, 2], [0, 1], [0.0, -1.0], "a"),
                      TrainingSequence([1, 3], [0, 1], [0.0, -1.0], "a")],
                     [TrainingSequence([1, 4, 5], [0, 1, 1], [0.0, -1.0, -1.0], "b")]]
    group = RolloutGroup(prompts=[[], []], reward_kwargs={}, completions=[[], []], completions_ids=[[2], [4, 5]],
                         completions_sequences=conversations, tool_call_counts=[0, 0], tool_failure_counts=[0, 0],
                         model_version=3, group_id=7, env_rewards=[None, None], rollout_rewards=[None, None])
    def length(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    loop = types.SimpleNamespace(reward_funcs=[length], reward_func_names=["length"], _env_reward_types=[],
                                 _provides_rollout_reward=False)
    samples = asyncio.run(_AsyncRolloutLoop._score_group(loop, group))
    assert [s.input_ids.tolist() for s in samples] == [[1, 2], [1, 3], [1, 4, 5]]
    assert samples[0].advantage == samples[1].advantage < samples[2].advantage  # one advantage per conversation
    assert {(s.model_version, s.group_id) for s in samples} == {(3, 7)}


def test_async_reduce_metric():
    """AsyncGSPOTrainer logs means as (sum, count) rates and names its extremes with a `max` / `min` word in the key's
    last path part: TRL's logger reduces each key's window by that shape and word (`_reduce_metric`, from `log`)."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

    assert _reduce_metric("gspo/behaviour_weight/mean", [(1.0, 2.0), (5.0, 2.0)]) == 1.5
    assert math.isnan(_reduce_metric("gspo/clipped_sequence_fraction/age_1", [(0.0, 0.0)]))
    assert _reduce_metric("gspo/ratio_max", [1.0, 3.0, 2.0]) == 3.0
    assert _reduce_metric("gspo/behaviour_weight/max_age_2", [1.0, 3.0]) == 3.0
    assert _reduce_metric("gspo/log_ratio_abs_max", [0.5, 0.25]) == 0.5
    assert _reduce_metric("clip_ratio/low_min", [0.5, 0.25]) == 0.25
    assert _reduce_metric("sample/dropped_stale_total", [1.0, 1.0, 1.0]) == 3.0
    assert _reduce_metric("max_x/gauge", [1.0, 3.0]) == 2.0 and _reduce_metric("gspo/ratio_std", [1.0, 3.0]) == 2.0
    assert "_reduce_metric(key, valid)" in inspect.getsource(AsyncGRPOTrainer.log)


def test_async_trained_groups_and_resume_position():
    """TRL counts the prompt groups trained in `_trained_groups` (its packer adds to it; AsyncGSPOTrainer adds a
    micro-batch's groups when it trains it), saves the first group not in it as the checkpoint's prompt position, and
    restarts the rollout worker there on resume; the epoch stop and `batch/groups_per_step` count it too."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import _EpochStopCallback

    save = inspect.getsource(AsyncGRPOTrainer._save_checkpoint)
    assert "trained = self._trained_groups" in save
    assert "next(g for g in itertools.count() if g not in trained)" in save and '"prompt_index": prompt_index' in save
    resume = inspect.getsource(AsyncGRPOTrainer._inner_training_loop)
    assert 'self.rollout_worker._loop_kwargs["dataset_start_index"] = rollout_state["prompt_index"]' in resume
    assert "len(self._trainer._trained_groups)" in inspect.getsource(_EpochStopCallback.on_step_end)


def test_async_grpo_config_fields_async_gspo_builds_on():
    """AsyncGSPOConfig overrides TRL's `epsilon` / `epsilon_high` defaults (its 'grpo' defaults are TRL's: 0.2, and
    `epsilon_high` unset meaning `epsilon`), adds fields TRL does not have, and reads these of TRL's. TRL's
    `__post_init__` makes the main process drive and dispatch the batches, which is why the packer repeats its counts
    per rank."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trl_gspo import AsyncGSPOConfig

    trl_fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    assert trl_fields["epsilon"].default == 0.2 and trl_fields["epsilon_high"].default is None
    assert trl_fields["max_staleness"].default == 4 and trl_fields["token_budget"].default is None
    assert {"heartbeat_stale_after_s", "router_aux_loss_coef", "per_device_train_batch_size", "report_to",
            "num_generations", "weight_sync_steps"} <= set(trl_fields)
    own = {f.name for f in dataclasses.fields(AsyncGSPOConfig)} - set(trl_fields)
    assert own == {"loss_type", "routing_replay", "delta", "staleness_correction", "staleness_weight_cap",
                   "exact_lora_merge", "clip_band", "clip_band_target", "clip_band_min", "clip_band_max",
                   "rank_wait_timeout", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                   "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"}  # the last six: GRPOConfig's, for the
    # losses AsyncGRPOConfig does not run
    args = AsyncGRPOConfig(output_dir="unused", use_cpu=True, report_to="none")
    assert args.accelerator_config.dispatch_batches is True and args.accelerator_config.split_batches is True


def test_async_pad_and_accelerate_collectives():
    """trl.trainer.utils.pad pads a list of tensors on the right (the packer's route and version columns);
    AsyncGSPOTrainer's metrics use accelerate's `reduce`, `pad_across_processes` and `gather` with these arguments."""
    from accelerate import Accelerator
    from trl.trainer.utils import pad

    assert pad([torch.tensor([1, 2]), torch.tensor([3])], padding_value=-1).tolist() == [[1, 2], [3, -1]]
    assert _parameters(Accelerator.reduce)[:3] == ["self", "tensor", "reduction"]
    assert _parameters(Accelerator.pad_across_processes)[:4] == ["self", "tensor", "dim", "pad_index"]
    assert _parameters(Accelerator.gather)[:2] == ["self", "tensor"]
