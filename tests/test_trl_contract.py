"""The TRL and transformers internals trl-gspo relies on, one test each (see docs/trl_contract.md).

A TRL or transformers release that renames, moves or changes one of them fails here, with the internal named in
the test, instead of silently changing what GSPOTrainer computes. Everything is checked against the installed
versions, by signature where a signature is the contract and by running it where behaviour is.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
from conftest import digit_reward, tiny_config, toy_dataset
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
from trl_gspo.trainer import _FORWARD_BATCH_KEYS, runs_old_policy_pass


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
    """Public-but-internal TRL/accelerate helpers the recipe launcher and reward resolution call."""
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
    """trl_gspo/tool_turns.py overrides `_tool_call_loop` (any arguments, passed through) and `_generate_single_turn`
    (called positionally with these five arguments), reads the TP group and mode of TRL's `VLLMGeneration`, and sets
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
