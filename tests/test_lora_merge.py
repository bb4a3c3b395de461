"""LoRA adapters folded into the weights without writing the frozen base (trl_gspo/lora_merge.py), and GSPOTrainer's
rollouts with them (trl_gspo/trainer/lora.py): bit-for-bit checks in float32 and bf16, against PEFT's active forward
and TRL's own weight-sync stream."""

import contextlib
import types

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset
from trl_gspo import GSPOTrainer
from trl_gspo.quickstart.model import build_model

import trl_gspo.lora_merge as lora_merge
from trl_gspo.lora_merge import LoraMergeError, adapter_targets, exact_sync_stream, merged_adapters

TARGETS = dict(target_modules=["q_proj", "v_proj"],
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def _peft_model(tokenizer, dtype, scale=0.05, seed=0, **lora):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model(tokenizer).to(dtype), LoraConfig(r=4, lora_alpha=8, **(lora or TARGETS)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero: give the adapters something to fold
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def _base(model):
    return {name: param.detach().clone() for name, param in model.named_parameters() if "lora_" not in name}


def _changed(model, base):
    return [name for name, param in model.named_parameters() if name in base and not torch.equal(param, base[name])]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _trl_stream(model):
    """TRL's own weight-sync stream (`VLLMGeneration._iter_named_params`) of one process, without a vLLM engine."""
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.model = model
    generation._dist = types.SimpleNamespace(gather_params=lambda params: contextlib.nullcontext(), is_fsdp=False)
    return generation._iter_named_params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_experts_equal_the_active_forward_and_the_base_is_untouched(tokenizer, dtype):
    model = _peft_model(tokenizer, dtype)
    base = _base(model)
    ids = torch.randint(3, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    active = _logits(model, ids)
    with merged_adapters(model, experts_only=True) as targets:
        assert len(targets) == 4 and all(t.expert_stack for t in targets)  # gate_up and down, 2 layers
        assert all(t.layer.merged for t in targets)
        experts_folded = _logits(model, ids)
    with merged_adapters(model) as targets:
        assert len(targets) == 8
        all_folded = _logits(model, ids)
    assert torch.equal(experts_folded, active)  # the experts' W + delta is the tensor the active forward builds
    assert not torch.equal(all_folded, active)  # folded attention: rounding only
    assert torch.allclose(all_folded, active, atol=2e-2 if dtype == torch.bfloat16 else 1e-4)
    assert _changed(model, base) == [] and not any(t.layer.merged for t in adapter_targets(model))
    assert torch.equal(_logits(model, ids), active)  # the adapters are live again


def test_folding_is_undone_when_the_block_raises(tokenizer):
    model = _peft_model(tokenizer, torch.bfloat16)
    base = _base(model)
    with pytest.raises(RuntimeError, match="mid-block"), merged_adapters(model):
        raise RuntimeError("mid-block")
    assert _changed(model, base) == [] and not any(t.layer.merged for t in adapter_targets(model))


def test_bf16_base_stays_frozen_across_weight_syncs_where_peft_merging_drifts(tokenizer):
    """TRL's sync stream merges and unmerges in place: in bf16 the base moves at every sync while the adapters
    train. Through `exact_sync_stream` it does not move at all, and what is sent equals PEFT's merge for attention
    and the active forward's weights for the experts."""
    torch.manual_seed(0)
    drifts = {}
    for exact in (False, True):
        model = _peft_model(tokenizer, torch.bfloat16)
        base, stream = _base(model), _trl_stream(model)
        adapters = [p for n, p in model.named_parameters() if "lora_" in n]
        for sync in range(20):
            sent = dict(exact_sync_stream(model, stream) if exact else ((n, t.clone()) for n, t in stream()))
            assert len(sent) == len(base)
            with torch.no_grad():  # the adapters train a little between syncs
                for param in adapters:
                    param.add_(torch.randn_like(param) * 1e-3)
        drifts[exact] = _changed(model, base)
    assert drifts[True] == []
    assert len(drifts[False]) >= 4, drifts  # stock TRL + PEFT: the frozen base drifts (8 of 8 adapted tensors here)


def test_sync_sends_the_folded_weights(tokenizer):
    model = _peft_model(tokenizer, torch.bfloat16)
    sent = dict(exact_sync_stream(model, _trl_stream(model)))
    with merged_adapters(model):
        folded = {name: param.detach().clone() for name, param in model.named_parameters()}
    stock = {name: tensor.clone() for name, tensor in _trl_stream(model)()}  # PEFT's in-place merge
    renamed = {name.removeprefix("base_model.model.").replace(".base_layer", ""): t for name, t in folded.items()}
    assert sent.keys() == stock.keys()
    for name, tensor in sent.items():
        assert torch.equal(tensor, renamed[name]), name
        if "experts" not in name:  # attention: PEFT's merge arithmetic, bit for bit
            assert torch.equal(tensor, stock[name]), name
    assert any(not torch.equal(sent[n], stock[n]) for n in sent if "experts" in n)  # PEFT's merge rounds twice


def test_a_sync_stream_that_copies_parameters_is_refused(tokenizer):
    model = _peft_model(tokenizer, torch.float32)
    stream = _trl_stream(model)
    with pytest.raises(LoraMergeError, match="exact_lora_merge"):
        list(exact_sync_stream(model, lambda: ((name, t.clone()) for name, t in stream())))
    assert "merge_adapter" not in vars(model)  # PEFT's methods are back


def test_trained_token_rows_and_modules_to_save_are_sent_as_peft_merges_them(tokenizer):
    """PEFT's merge also folds trained token rows (`trainable_token_indices`) into the embedding, and TRL's stream sends
    a `modules_to_save` copy under the original's name: the exact sync sends both as PEFT would, bit for bit, and
    leaves the base untouched."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model(tokenizer).to(torch.bfloat16), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[3, 5, 7], modules_to_save=["norm"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained adapters, token rows and saved module
        for name, param in model.named_parameters():
            if "lora_B" in name or "trainable_tokens_delta" in name or "modules_to_save" in name:
                param.add_((torch.randn(param.shape, generator=generator) * 0.5).to(param.dtype))
    assert adapter_targets(model) and all(t.token_rows for t in adapter_targets(model) if "Embedding" in
                                          type(t.owner).__name__)
    base = _base(model)
    sent = dict(exact_sync_stream(model, _trl_stream(model)))
    assert _changed(model, base) == []
    stock = {name: tensor.clone() for name, tensor in _trl_stream(model)()}  # PEFT's in-place merge
    assert sent.keys() == stock.keys()
    embedding = next(name for name in sent if "embed_tokens" in name and name.endswith(".weight"))
    assert not torch.equal(sent[embedding], base["base_model.model.model.embed_tokens.token_adapter.base_layer.weight"])
    assert [name for name in sent if not torch.equal(sent[name], stock[name])] == []


def _server_trainer(model, main: bool):
    """What TrainerLora reads of a GSPOTrainer in vLLM server mode, around TRL's own `VLLMGeneration.sync_weights`."""
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.model, generation.mode, generation.enable_sleep_mode, generation._weight_metadata = (
        model, "server", False, None)
    generation._dist = types.SimpleNamespace(gather_params=lambda params: contextlib.nullcontext(), is_fsdp=False)
    accelerator = types.SimpleNamespace(is_main_process=main, unwrap_model=lambda m: m, state=types.SimpleNamespace(),
                                        num_processes=1, process_index=0, device=torch.device("cpu"))
    generation.accelerator = accelerator
    sent = []
    generation.vllm_client = types.SimpleNamespace(
        update_named_params=lambda metadata, stream: sent.append({name: t.clone() for name, t in stream}),
        reset_prefix_cache=lambda: None)
    trainer = types.SimpleNamespace(model=model, accelerator=accelerator, use_vllm=True, is_fsdp_enabled=False,
                                    is_deepspeed_enabled=False,
                                    vllm_generation=generation,
                                    args=_args(use_vllm=True))
    return trainer, sent


def _args(**overrides):
    """The fields of a GSPOConfig that TrainerLora reads (4 mini-batches per rollout: TRL runs an old-policy pass)."""
    fields = dict(exact_lora_merge=True, merge_adapters_for_rollout=True, ds3_gather_for_generation=True,
                  steps_per_generation=4, num_iterations=1, gradient_accumulation_steps=1, use_vllm=False,
                  vllm_importance_sampling_correction=True)
    return types.SimpleNamespace(**{**fields, **overrides})


@pytest.mark.parametrize("main", [True, False])
def test_server_syncs_build_only_what_the_main_rank_sends(tokenizer, monkeypatch, main):
    """The server's metadata walk and a non-main rank's walk send nothing: no `W + delta` is built for them. The main
    rank builds each adapted tensor once per sync, and sends the folded weights."""
    from trl_gspo.trainer.lora import TrainerLora

    model = _peft_model(tokenizer, torch.bfloat16)
    builds = _count_builds(monkeypatch)
    trainer, sent = _server_trainer(model, main)
    TrainerLora.build(trainer)
    trainer.vllm_generation.sync_weights()  # the first sync: a metadata walk, then the sending walk
    assert len(builds) == (8 if main else 0)
    trainer.vllm_generation.sync_weights()
    assert len(builds) == (16 if main else 0)
    if main:
        expected = dict(exact_sync_stream(model, _trl_stream(model)))
        assert sent[0].keys() == expected.keys()
        assert all(torch.equal(sent[1][name], expected[name]) for name in expected)


def test_a_copying_stream_fails_at_the_servers_metadata_walk_before_anything_is_sent(tokenizer):
    """A stream that copies the adapted tensors raises `LoraMergeError` on every rank during the metadata walk of the
    first sync, before any tensor reaches the server's collective."""
    from trl_gspo.trainer.lora import TrainerLora

    for main in (True, False):
        model = _peft_model(tokenizer, torch.float32)
        trainer, sent = _server_trainer(model, main)
        generation = trainer.vllm_generation
        stream = generation._iter_named_params
        generation._iter_named_params = lambda: ((name, t.clone()) for name, t in stream())
        TrainerLora.build(trainer)
        with pytest.raises(LoraMergeError, match="exact_lora_merge"):
            generation.sync_weights()
        assert sent == [] and generation._weight_metadata is None


class _PackedTransfer:
    """The server side of TRL's packed weight transfer (`VLLMClient.update_named_params`): the `/update_weights`
    request runs in a thread and returns only once every announced tensor has arrived, while the trainer's thread
    streams them. A real server waits forever for a missing tensor; this one gives up after `patience` seconds, and
    says so in `gave_up`."""

    def __init__(self, patience: float):
        import queue

        self.patience, self.arrived, self.received, self.gave_up = patience, queue.Queue(), [], False

    def update_named_params(self, metadata, named_params):
        import concurrent.futures
        import queue

        def server():
            for _ in metadata:
                try:
                    self.received.append(self.arrived.get(timeout=self.patience))
                except queue.Empty:
                    self.gave_up = True
                    raise

        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
            request = executor.submit(server)
            for name, tensor in named_params:
                self.arrived.put(name)
            request.result()


def test_a_failure_mid_way_through_a_server_sync_stops_the_run_without_a_hang(tokenizer, monkeypatch):
    """Building one `W + delta` fails half-way through the stream the server is receiving: the transfer still
    completes (every announced tensor arrives, so the server's request returns), and the sync raises one
    LoraMergeError at once, naming the tensor and chained to the cause: the server never waited out its patience on
    a missing tensor (it says so, rather than the test timing it)."""
    from trl_gspo.trainer.lora import TrainerLora

    model = _peft_model(tokenizer, torch.bfloat16)
    trainer, _ = _server_trainer(model, main=True)
    transfer = _PackedTransfer(patience=30.0)
    trainer.vllm_generation.vllm_client.update_named_params = transfer.update_named_params
    TrainerLora.build(trainer)
    base = _base(model)
    builds, original = [], lora_merge.effective_weight

    def failing(target):
        builds.append(target)
        if len(builds) == 4:
            raise RuntimeError("out of memory (simulated)")
        return original(target)

    monkeypatch.setattr(lora_merge, "effective_weight", failing)
    with pytest.raises(LoraMergeError, match="simulated") as raised:
        trainer.vllm_generation.sync_weights()
    assert not transfer.gave_up  # nothing waited on a missing tensor
    assert isinstance(raised.value.__cause__.__cause__, RuntimeError)
    assert len(transfer.received) == len(trainer.vllm_generation._weight_metadata)
    assert _changed(model, base) == [] and "merge_adapter" not in vars(model)


def _count_builds(monkeypatch):
    builds = []
    original = lora_merge.effective_weight

    def counting(target):
        builds.append(target.expert_stack)
        return original(target)

    monkeypatch.setattr(lora_merge, "effective_weight", counting)
    return builds


def _train(tokenizer, tmp_path, fold):
    from peft import LoraConfig

    model = build_model(tokenizer).to(torch.bfloat16)
    base = {name: param.detach().clone() for name, param in model.named_parameters()}
    trainer = GSPOTrainer(model, digit_reward, args=tiny_config(tmp_path, max_steps=8, steps_per_generation=4,
                                                                per_device_train_batch_size=4, learning_rate=5e-2,
                                                                merge_adapters_for_rollout=fold),
                          train_dataset=toy_dataset(), processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8, **TARGETS))
    trainer.train()
    after = {name.replace(".base_layer", ""): param for name, param in trainer.model.get_base_model().named_parameters()
             if "lora_" not in name}
    assert after.keys() == base.keys()
    assert [name for name in base if not torch.equal(after[name], base[name])] == []  # the bf16 base, bit for bit
    return [{k: v for k, v in h.items() if "time" not in k and "runtime" not in k and "per_second" not in k}
            for h in trainer.state.log_history]


def test_rollouts_fold_the_experts_and_change_nothing_bit_for_bit(tmp_path, tokenizer, monkeypatch):
    """A bf16 base with LoRA on attention and experts, HF generate, 4 mini-batches per rollout: generation and the
    old-policy pass run with the experts folded, built once per rollout, and the run is bit for bit the run with the
    adapters active (every logged value: samples, rewards, losses, grad norms); the first mini-batch of each rollout
    has log-ratio exactly 0, and the base is unchanged."""
    builds = _count_builds(monkeypatch)
    blocks = []
    folding = lora_merge.merged_adapters

    def watching(model_, experts_only=False, cache=None):
        blocks.append((experts_only, torch.is_grad_enabled(), cache is not None))
        return folding(model_, experts_only, cache)

    monkeypatch.setattr("trl_gspo.trainer.lora.merged_adapters", watching)
    folded = _train(tokenizer, tmp_path / "folded", fold=True)
    assert blocks == [(True, False, True)] * 4  # per rollout: generate, then the old-policy pass
    assert sum(builds) == 2 * 4  # the experts' W + delta: 4 tensors, built once in each of the 2 rollouts
    active = _train(tokenizer, tmp_path / "active", fold=False)
    assert len(blocks) == 4
    held = [h.pop("lora/folded_rollout_bytes") for h in folded if "lora/folded_rollout_bytes" in h]
    experts = sum(t.parameter.nbytes for t in adapter_targets(_peft_model(tokenizer, torch.bfloat16, **TARGETS),
                                                                         experts_only=True))
    assert held and set(held) == {float(experts)}  # the folded copy, logged: the experts' adapted weights
    assert not any("lora/folded_rollout_bytes" in h for h in active)
    assert folded == active
    logs = [h for h in folded if "loss" in h]
    assert len(logs) == 8
    assert [h["gspo/log_ratio_abs_max"] for h in logs][::4] == [0.0, 0.0]  # on-policy: pi_theta == pi_old exactly
    assert max(h["gspo/log_ratio_abs_max"] for h in logs) > 0  # the adapters trained


@pytest.mark.parametrize("held", [3 * 2**29, None])
def test_the_run_summary_names_the_folded_rollouts_memory(held, tmp_path, capsys):
    from trl_gspo.launch.reporting import RunReportCallback

    history = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}]
    if held is not None:
        history[0]["lora/folded_rollout_bytes"] = history[1]["lora/folded_rollout_bytes"] = float(held)
    args = types.SimpleNamespace(output_dir=str(tmp_path), loss_type="gspo")
    state = types.SimpleNamespace(is_world_process_zero=True, log_history=history, global_step=2)
    callback = RunReportCallback(plot=False)
    callback.on_train_begin(args, state, None)
    callback.on_train_end(args, state, None)
    assert ("LoRA folded rollout:   1.500 GiB of expert weights held per rank" in capsys.readouterr().out) == bool(held)


# Whole or sharded: folding reads and replaces whole weights, so it runs only where `model_is_whole` says so, and a run
# that folds no expert says why at start.

ROUTER = dict(target_modules=["q_proj", "v_proj"],  # PEFT allows a 2-D `target_parameters` too: here the router
              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"])
NOT_FOLDED = "LoRA: expert adapters are not folded for rollouts: "


def _hf_trainer(model, main=True, state=None, **args):
    """What TrainerLora reads of a GSPOTrainer that generates with HF generate on one process (`state`: accelerate's
    plugins)."""
    import collections

    accelerator = types.SimpleNamespace(is_main_process=main, unwrap_model=lambda m: m,
                                        state=types.SimpleNamespace(**(state or {})))
    return types.SimpleNamespace(model=model, accelerator=accelerator, use_vllm=args.get("use_vllm", False),
                                 is_fsdp_enabled="fsdp_plugin" in (state or {}),
                                 is_deepspeed_enabled="deepspeed_plugin" in (state or {}),
                                 _metrics={"train": collections.defaultdict(list)}, args=_args(**args))


def test_a_2d_target_parameter_on_one_process_is_whole_and_folded(tokenizer):
    """A 2-D parameter in `target_parameters` (the router, beside the 3-D fused experts) is no shard: on one process
    the model is whole, a rollout folds it with the experts, and the folded forward is the active one bit for bit."""
    from trl_gspo.lora_merge import model_is_whole
    from trl_gspo.trainer.lora import TrainerLora

    model = _peft_model(tokenizer, torch.bfloat16, **ROUTER)
    targets = adapter_targets(model, experts_only=True)
    assert sorted(t.parameter.dim() for t in targets) == [2, 2, 3, 3, 3, 3]  # 2 layers: router, gate_up, down
    assert model_is_whole(model)
    ids = torch.randint(3, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    active = _logits(model, ids)
    with merged_adapters(model, experts_only=True):
        assert torch.equal(_logits(model, ids), active)
    trainer = _hf_trainer(model)
    lora = TrainerLora.build(trainer)
    assert lora._not_folding() is None
    with lora.rollout():
        model.generate(input_ids=ids[:, :5], max_new_tokens=2, do_sample=False)
    assert trainer._metrics["train"][TrainerLora.FOLDED_BYTES] == [float(sum(t.parameter.nbytes for t in targets))]


def _fsdp1_is_whole(rank: int, init_file: str, out: str) -> None:
    """One of two gloo processes: the tiny model with LoRA under torch's FSDP v1, `use_orig_params` true and false,
    wrapped at the root only and by PEFT's wrap policy; what `model_is_whole` says of the wrapper and of the module
    inside it (what `accelerator.unwrap_model` returns), once wrapped and after a forward."""
    import json

    import torch.distributed as dist
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel
    from trl_gspo.lora_merge import model_is_whole
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        seen, tokenizer = {}, build_tokenizer()
        for orig in (True, False):
            for policy in ("root", "peft"):
                model = _peft_model(tokenizer, torch.float32, target_modules=["q_proj", "v_proj"])
                if policy == "root" and not orig:
                    model.requires_grad_(True)  # one flat parameter: all trainable or all frozen
                wrapped = FullyShardedDataParallel(
                    model, device_id=torch.device("cpu"), use_orig_params=orig,
                    auto_wrap_policy=fsdp_auto_wrap_policy(model) if policy == "peft" else None)
                seen[f"use_orig_params={orig}, {policy}"] = [model_is_whole(wrapped), model_is_whole(wrapped.module)]
                with torch.no_grad():
                    wrapped(input_ids=torch.tensor([[5, 6, 7, 8]]))
                seen[f"use_orig_params={orig}, {policy}, after a forward"] = [
                    model_is_whole(wrapped), model_is_whole(wrapped.module)]
        with open(f"{out}/rank{rank}.json", "w") as file:
            json.dump(seen, file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_v1_is_sharded_with_and_without_orig_params(tmp_path):
    """FSDP v1 leaves 1-D views of each rank's shard (`use_orig_params=True`) or plain tensors of full shape over
    freed storage (`False`): neither is whole, on either rank, whether the wrapper or the module inside it is asked."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_fsdp1_is_whole, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(seen) == 8 and all(answer == [False, False] for answer in seen.values()), (rank, seen)


@pytest.mark.parametrize("case, level, reason", [
    ("option off", "INFO", "`merge_adapters_for_rollout` is off"),
    ("attention only", "INFO", "no parameter is adapted directly"),
    ("vLLM, on-policy", "INFO", "vLLM generates and no old-policy forward runs"),
    ("FSDP2", "INFO", "under FSDP each unit is gathered in its own forward"),
    ("ZeRO-3 layer by layer", "INFO",
     "under ZeRO-3 the old-policy pass runs on shards and generation is gathered layer by layer"),
    ("ZeRO-3, vLLM", "INFO", "under ZeRO-3 the old-policy pass runs on shards and generation is vLLM's"),
    ("sharded, no plugin says so", "WARNING", "the weights are sharded (DTensor, ZeRO-3 or FSDP v1"),
    ("folding", None, None),
])
def test_a_run_that_folds_no_expert_says_why_in_one_line(tokenizer, caplog, case, level, reason):
    """One line at start, on the main process only, names the check that turned expert folding off: information where
    a setting of the run explains it (the option, the targets, vLLM, FSDP, ZeRO-3), a warning where none does
    (weights sharded some other way). None where it folds."""
    import logging

    from trl_gspo.trainer.lora import TrainerLora

    model = _peft_model(tokenizer, torch.bfloat16, **(dict(target_modules=["q_proj"]) if case == "attention only"
                                                       else TARGETS))
    zero3 = {"deepspeed_plugin": types.SimpleNamespace(zero_stage=3)}
    options = {"option off": dict(merge_adapters_for_rollout=False),
               "vLLM, on-policy": dict(use_vllm=True, exact_lora_merge=False, steps_per_generation=1,
                                       vllm_importance_sampling_correction=False),
               "FSDP2": dict(state={"fsdp_plugin": types.SimpleNamespace(fsdp_version=2)}),
               "ZeRO-3 layer by layer": dict(state=zero3, ds3_gather_for_generation=False),
               "ZeRO-3, vLLM": dict(state=zero3, use_vllm=True, exact_lora_merge=False)}.get(case, {})
    if case == "sharded, no plugin says so":  # what FSDP v1 leaves on a parameter of a model wrapped at its root
        next(model.parameters())._fsdp_flattened = True
    for main in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trl_gspo.trainer.lora"):
            TrainerLora.build(_hf_trainer(model, main=main, **options))
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith(NOT_FOLDED)]
        if level is None or not main:
            assert lines == []
        else:
            assert len(lines) == 1 and lines[0][0] == level and lines[0][1].startswith(NOT_FOLDED + reason), lines
