"""One cell or more of the fault matrix (benchmarks/fault_matrix.py, docs/reliability.md): a trainer on two processes
under `accelerate launch` (DDP or real DeepSpeed ZeRO over gloo), one fault injected on one rank, and what each rank
did about it.

    accelerate launch --config_file recipes/accelerate/cpu_zero3.yaml --num_processes 2 fault_run.py OUT_DIR \
        [--trainer gspo-server|gspo-hf|async] [--model-dir DIR] CELL [CELL ...]

A CELL is `[TRAINER:]FAULT@RANK` (`server-before-stream@0`, `async:async-pause@0`; the trainer defaults to
--trainer). Cells run one after another in the same processes, each with its own trainer and OUT_DIR/CELL (":" as "-"); a cell that ends the processes (the watch stopped a rank)
must be the last. Each rank writes OUT_DIR/CELL/rank<r>.json: the error's class, its message with the notes
trl-gspo adds (the phase and what to do), whether the watch stopped the rank (`stopped_by_watch`), and the seconds
from the fault to the stop (the fault's rank writes its clock to OUT_DIR/CELL/fault_at; the ranks share one clock).

Faults, all at the second optimizer step (checkpoints are saved every step, so checkpoint-1 is the newest complete):
- `server-before-stream`, `server-mid-stream`, `server-generate` (gspo-server): the stand-in server refuses the
  connection before the weight stream, halfway through it, or at the generation request (main process only: the
  others never talk to the server). TRL's own `VLLMGeneration` and `DistributedBackend` run, so under ZeRO-3 each
  streamed parameter is a real gather.
- `lora-build` (gspo-server, main process): building one `W + delta` for the weight sync fails.
- `async-pause`, `async-send`, `async-resume` (async, main process): the weight transfer fails there.
- `generate-fails` (gspo-hf): the rank's HF `generate` raises.
- `reward-raises`, `reward-hangs` (gspo-*): a reward function raises, or never returns (`rank_wait_timeout` 8 s).
- `save-fails`: the rank's checkpoint write fails as on a full disk (ENOSPC).
- `nan`: a NaN in the rank's log-probs. `oom`: the rank's backward raises out of memory.
"""

import argparse
import errno
import functools
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the stand-ins
sys.path.insert(0, str(HERE))
from support.helpers import digit_reward, tiny_config, toy_dataset  # noqa: E402

import trl_gspo.lora_merge as lora_merge  # noqa: E402
import trl_gspo.ranks.watch as rank_watch  # noqa: E402

STEP = 2  # the optimizer step (1-based) at which every fault fires
SERVER_FAULTS = ("server-before-stream", "server-mid-stream", "server-generate", "lora-build")
ASYNC_FAULTS = ("async-pause", "async-send", "async-resume")
ANY_FAULTS = ("reward-raises", "reward-hangs", "save-fails", "nan", "oom")
HF_FAULTS = ("generate-fails",)
FAULTS = SERVER_FAULTS + ASYNC_FAULTS + ANY_FAULTS + HF_FAULTS


class Cell:
    def __init__(self, spec: str, out_dir: Path, rank: int, trainer: str):
        self.trainer, _, cell = spec.rpartition(":")
        self.trainer = self.trainer or trainer
        self.fault, at = cell.split("@")
        self.rank_of_fault, self.dir, self.rank = int(at), out_dir / spec.replace(":", "-"), rank
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def here(self) -> bool:
        return self.rank == self.rank_of_fault

    def fire(self, what: str):
        (self.dir / "fault_at").write_text(repr(time.time()))
        return what

    def report(self, **fields):
        fault_at = self.dir / "fault_at"
        fields["seconds_after_fault"] = (time.time() - float(fault_at.read_text())) if fault_at.exists() else None
        (self.dir / f"rank{self.rank}.json").write_text(json.dumps(fields))


def connection_refused(cell: Cell):
    import requests

    return requests.exceptions.ConnectionError(cell.fire("connection refused (stand-in server)"))


class StandInServer:
    """The main process's `VLLMClient`: completions of fixed random tokens, a weight transfer that reads every
    streamed tensor, and the cell's server fault at the second sync or generation request."""

    def __init__(self, vocab: int, cell: Cell):
        self.base_url, self.vocab, self.cell = "http://127.0.0.1:1", vocab, cell
        self.session = types.SimpleNamespace(post=None)
        self.requests = self.syncs = 0

    def generate(self, prompts, n, max_tokens, **_):
        self.requests += 1
        if self.cell.fault == "server-generate" and self.requests == STEP:
            raise connection_refused(self.cell)
        generator = torch.Generator().manual_seed(self.requests)
        completions = [torch.randint(3, self.vocab, (max_tokens,), generator=generator).tolist()
                       for _ in range(len(prompts) * n)]
        return {"prompt_ids": prompts, "completion_ids": completions,
                "logprobs": [[[-2.0]] * len(ids) for ids in completions], "logprob_token_ids": None}

    def update_named_params(self, metadata, named_params):
        self.syncs += 1  # the first sync is at step 1's generation
        if self.cell.fault == "server-before-stream" and self.syncs == STEP:
            raise connection_refused(self.cell)
        received = 0
        for _ in named_params:
            received += 1
            if self.cell.fault == "server-mid-stream" and self.syncs == STEP and received == len(metadata) // 2:
                raise connection_refused(self.cell)
        assert received == len(metadata)

    def reset_prefix_cache(self):
        pass


def serve(trainer, tokenizer, cell: Cell) -> None:
    """The HF-generate trainer made a server-mode one: TRL's `VLLMGeneration` with its real `DistributedBackend`
    (ZeRO-3 gathers for real), the stand-in client on the main process."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_gspo.ranks.phases import agreed_server_sync

    generation = VLLMGeneration.__new__(VLLMGeneration)
    args = trainer.args
    vars(generation).update(
        model=trainer.accelerator.unwrap_model(trainer.model), accelerator=trainer.accelerator, mode="server",
        enable_sleep_mode=False, _weight_metadata=None, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        max_completion_length=args.max_completion_length, logprobs=0, structured_outputs_regex=None,
        generation_kwargs={}, _dist=DistributedBackend(trainer.accelerator))
    if trainer.accelerator.is_main_process:
        generation.vllm_client = StandInServer(len(tokenizer), cell)
    trainer.vllm_generation, trainer.use_vllm, trainer.vllm_mode = generation, True, "server"
    trainer._last_loaded_step = 0
    trainer.vllm_importance_sampling_correction = False
    if trainer._lora is not None:  # what TrainerLora.build installs when the trainer uses vLLM
        trainer._lora._install_exact_sync()
    agreed_server_sync(trainer)


def reward_for(cell: Cell):
    calls = []

    def reward(completions, **kwargs):
        calls.append(True)
        if cell.here and len(calls) == STEP:
            if cell.fault == "reward-raises":
                raise ValueError(cell.fire("the reward function failed (stand-in)"))
            if cell.fault == "reward-hangs":
                cell.fire("hang")
                while True:
                    time.sleep(60)
        return digit_reward(completions, **kwargs)
    return reward


def inject_common(trainer, cell: Cell) -> None:
    """The faults any trainer can meet on one rank: a full disk, a NaN, out of memory."""
    if not cell.here:
        return
    if cell.fault == "save-fails":
        save_rng_state = trainer._save_rng_state

        def full_disk(output_dir):
            if trainer.state.global_step == STEP:
                raise OSError(errno.ENOSPC, cell.fire("No space left on device (stand-in)"))
            return save_rng_state(output_dir)
        trainer._save_rng_state = full_disk
    if cell.fault == "nan":
        compute_loss = trainer.compute_loss

        def poisoned(model, inputs, *args, **kwargs):
            if trainer.state.global_step == STEP - 1:
                key = "old_log_probs" if "old_log_probs" in inputs else "advantages"
                inputs[key] = inputs[key].clone()
                inputs[key].view(-1)[0] = float("nan")
                cell.fire("nan")
            return compute_loss(model, inputs, *args, **kwargs)
        trainer.compute_loss = poisoned
    if cell.fault == "oom":
        backward = trainer.accelerator.backward

        def out_of_memory(loss, **kwargs):
            if trainer.state.global_step == STEP - 1:
                raise torch.OutOfMemoryError(cell.fire("CUDA out of memory. Tried to allocate 2.00 GiB (stand-in)"))
            return backward(loss, **kwargs)
        trainer.accelerator.backward = out_of_memory


def gspo_trainer(cell: Cell, out: Path, with_server: bool):
    from peft import LoraConfig

    from trl_gspo import GSPOTrainer
    from trl_gspo.quickstart.model import build_model
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0)
    args = tiny_config(out, loss_type="gspo", max_steps=3, per_device_train_batch_size=4, ddp_backend="gloo",
                       save_strategy="steps", save_steps=1, steps_per_generation=1, rank_wait_timeout=8)
    lora = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = GSPOTrainer(model, reward_for(cell), args=args, train_dataset=toy_dataset(), processing_class=tokenizer,
                          peft_config=lora if cell.fault == "lora-build" else None)
    if with_server:
        serve(trainer, tokenizer, cell)
    if cell.fault == "lora-build" and cell.here:
        builds = []

        def failing(target, original=lora_merge.effective_weight):
            builds.append(target)
            if len(builds) == 2:
                raise RuntimeError(cell.fire("out of memory building W + delta (stand-in)"))
            return original(target)
        lora_merge.effective_weight = failing
    if cell.fault == "generate-fails" and cell.here:
        model, calls = trainer.accelerator.unwrap_model(trainer.model), []
        generate = model.generate

        def failing_generate(*args, **kwargs):
            calls.append(True)
            if len(calls) == STEP:
                raise RuntimeError(cell.fire("generation failed (stand-in)"))
            return generate(*args, **kwargs)
        model.generate = failing_generate
    inject_common(trainer, cell)
    return trainer


class FailingTransfer:
    """The main process's weight transfer, failing at the cell's point of its second sync."""

    def __init__(self, cell: Cell):
        self.cell, self.syncs = cell, 0

    def init_weight_transfer(self):
        pass

    def destroy(self):
        pass

    def pause(self):
        self.syncs += 1  # the first sync is at the start of training, before step 1
        if self.cell.fault == "async-pause" and self.syncs == STEP + 1:
            raise connection_refused(self.cell)

    def send_weights(self, weights):
        for i, _ in enumerate(weights):
            if self.cell.fault == "async-send" and self.syncs == STEP + 1 and i == 3:
                raise connection_refused(self.cell)

    def resume(self):
        if self.cell.fault == "async-resume" and self.syncs == STEP + 1:
            raise connection_refused(self.cell)


def async_trainer(cell: Cell, out: Path, model_dir: str):
    import async_multiprocess_run as async_run
    from datasets import Dataset
    from support.async_stand_ins import NoWeightTransfer, QueueWorker
    from transformers import AutoTokenizer

    import trl_gspo.async_trainer
    from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer

    trl_gspo.async_trainer.trainer.FixedCountBatcher = async_run.PlannedBatcher
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    args = AsyncGSPOConfig(output_dir=str(out), use_cpu=True, report_to="none", max_steps=3,
                           per_device_train_batch_size=async_run.SAMPLES_PER_STEP // processes, num_generations=4,
                           gradient_accumulation_steps=2, epsilon=3e-4, epsilon_high=4e-4, token_budget=0,
                           logging_steps=1, save_strategy="steps", save_steps=1, disable_tqdm=True, seed=0,
                           learning_rate=1e-3, max_staleness=8, router_aux_loss_coef=0.0, ddp_backend="gloo",
                           rank_wait_timeout=8, weight_sync_steps=1)
    main = int(os.environ.get("RANK", "0")) == 0
    trainer = AsyncGSPOTrainer(model=model_dir, args=args, train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}),
                               processing_class=tokenizer, rollout_worker=QueueWorker(async_run.samples(5, 2, 2, 4)),
                               weight_transfer=FailingTransfer(cell) if main else NoWeightTransfer())
    inject_common(trainer, cell)
    return trainer


def run_cell(cell: Cell, options) -> bool:
    """Trains the cell; True when training ended without an error."""
    out = cell.dir / "run"
    if cell.trainer == "async":
        trainer = async_trainer(cell, out, options.model_dir)
    else:
        trainer = gspo_trainer(cell, out, with_server=cell.trainer == "gspo-server")
    try:
        trainer.train()
    except BaseException as error:  # noqa: BLE001 - reported
        traceback.print_exc()
        cell.report(error=type(error).__name__, text="".join(traceback.format_exception_only(error)).strip(),
                    stopped_by_watch=False)
        return False
    cell.report(error=None, text="", stopped_by_watch=False)
    return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("cells", nargs="+")
    parser.add_argument("--trainer", choices=["gspo-server", "gspo-hf", "async"], default="gspo-server")
    parser.add_argument("--model-dir")
    options = parser.parse_args()
    torch.set_num_threads(1)
    try:  # skip DeepSpeed's 60-80 s JIT build of a shared-memory op that gloo on CPU does not need
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except ImportError:
        pass
    rank = int(os.environ.get("RANK", "0"))
    current = []

    def stopped_by_watch(report):  # the watch ends this process: its report first
        current[-1].report(error=report["error"], text=f"{report['error']}: {report['message']} [raised on rank "
                           f"{report['rank']} while {report['phase']}. What to do: {report.get('advice', '')}]",
                           stopped_by_watch=True)

    rank_watch.RankWatch.start = functools.partial(rank_watch.RankWatch.start.__func__, rank_watch.RankWatch,
                                                   on_stop=stopped_by_watch)
    finished = []
    for spec in options.cells:
        cell = Cell(spec, options.out_dir, rank, options.trainer)
        assert cell.fault in FAULTS, spec
        current.append(cell)
        finished.append(run_cell(cell, options))
    sys.exit(0 if all(finished) else 1)  # as a run would: non-zero once a cell stopped with an error


if __name__ == "__main__":
    main()
