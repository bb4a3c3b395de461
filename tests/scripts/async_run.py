"""One run of TRL's asynchronous trainer against a real vLLM CPU server, for tests/test_async_vllm.py.

    async_run.py OUT_DIR '{"server": "http://127.0.0.1:PORT", "model_dir": "...", ...}'

The server (started by the test: `trl-gspo vllm-serve --model MODEL_DIR --worker-extension-cls
support.async_weight_files.LoadWeightsFile`, tests/support/vllm_cpu_engine.py as its vLLM plugin) serves MODEL_DIR,
the tiny Qwen3-MoE with the tool tokenizer's chat template (`build_model_dir`); the trainer loads the same directory,
so the rollout worker asks the server for the model under that name. On the trainer's side, test-only:
tests/support/async_stand_ins.py (tree attention through SDPA, no CUDA device name) and
tests/support/async_weight_files.py (weights through a file instead of TRL's NCCL transfer). Everything else is TRL's:
its rollout worker (a child process on `/v1/completions`), its queue and staleness filter, its weight-sync callbacks,
its checkpoints (`rollout_state.json`) and resume.

Options (JSON), all optional but `server` and `model_dir`:
    trainer          "trl" (AsyncGRPOTrainer / AsyncGRPOConfig) or "gspo" (trl_gspo.AsyncGSPOTrainer /
                     AsyncGSPOConfig, with `loss_type`)
    loss_type        for "gspo": "gspo", "gspo_token" or "grpo"
    transfer         "files" (every transfer reaches the server) or "cold_only" (the cold sync at train begin does,
                     every later one is read and dropped: a negative control)
    probe            after the cold sync and after every step's transfer, compare the server's log-probs of fixed
                     token sequences (`prompt_logprobs`) with the trainer's weights (a plain transformers copy,
                     float32) and with the initial weights
    queued_before_transfer  at every optimizer step, before that step's weight transfer, wait until the rollout
                     queue holds a sample (generated at the version about to be replaced): a slow trainer whose
                     generator runs ahead, by condition rather than by a sleep that a slow generator could outlast
    resume           resume from the newest checkpoint in OUT_DIR
    summary          add trl-gspo's end-of-run report (`RunReportCallback`, no plot): its lines go into RESULT
    any other key    an AsyncGRPOConfig field (max_steps, learning_rate, max_staleness, save_steps, ...)

`queue_maxsize` is 16 here (TRL: 1024): at the end of training TRL stops its rollout worker, whose child process
cannot exit while the samples it queued are not read (multiprocessing flushes a queue's buffer to its pipe before a
process ends): with a full queue of 1024 TRL waited 15 s and then terminated the child, in every run.

Writes OUT_DIR/steps.jsonl as it trains (one line per optimizer step, flushed: a killed run leaves it),
OUT_DIR/collated.jsonl (the group ids of each micro-batch when the collator packs it, flushed) and prints
`SAVED <step>` after each checkpoint and one line `RESULT {json}` at the end (also OUT_DIR/result.json): log history,
probes, transfers, what each step trained (prompt indices, group ids, the model version of each sample, that of the
trainer when TRL's queue dataset took it, `pulled_at`, where TRL checks staleness, and when it trained it).
"""

import collections
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import requests
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "scripts"))

# Operands of the toy prompts: prompt i is f"{i}+{(7 * i) % 50}=", distinct for every i.
NUM_PROMPTS = 64
PROBE_TEXTS = [("3+4=", "7"), ("12+30=", "42 and"), ("5+678=", "683"), ("99+1=", "100.")]


def digit_fraction(completions, **kwargs):
    """Toy reward: the fraction of the answer's characters that are digits (varies within a group of a random model,
    so advantages are not all zero). Module-level: TRL's rollout worker pickles it into its child process."""
    texts = [completion[-1]["content"] if completion else "" for completion in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


def prompt_text(i: int) -> str:
    return f"{i}+{(7 * i) % 50}="


def build_model_dir(path: Path) -> Path:
    """The tiny Qwen3-MoE with the tool tokenizer (a chat template, which TRL's rollout worker applies to every
    prompt, and a response template, which its `parse_response` needs), random weights (no cold start)."""
    from trl_gspo.quickstart.tools import build_tool_model

    if not path.exists():
        staging = path.with_name(f".{path.name}.partial")
        build_tool_model(str(staging), sft_steps=0)
        staging.rename(path)
    return path


class VersionTap:
    """TRL's rollout queue, seen through: remembers the last sample the trainer took (its `model_version`)."""

    def __init__(self, queue):
        self._queue = queue
        self.last = None

    def get(self, *args, **kwargs):
        self.last = self._queue.get(*args, **kwargs)
        return self.last

    def __getattr__(self, name):
        return getattr(self._queue, name)


def install_taps(pending, collated_file):
    """Record, for every trained micro-batch, its samples' model versions, group ids and prompts: the queue dataset's
    items get the version of the sample they came from, and the collator appends each micro-batch's record to
    `pending` (consumed by `training_step`, in the same order: the dataloader fetches ahead of training) and their
    group ids to `collated_file`."""
    from trl.experimental.async_grpo import async_grpo_trainer as module

    original_iter = module.RolloutQueueDataset.__iter__
    original_call = module.DataCollatorForRollout.torch_call

    def iterate(self):
        for item in original_iter(self):
            item["model_version"] = int(self.queue.last.model_version)
            item["pulled_at"] = int(self.model_version_fn())  # the trainer's version when TRL checked staleness
            yield item

    def torch_call(self, examples):
        batch = original_call(self, examples)
        (rows,) = examples
        collated_file.write(json.dumps(sorted({int(e["group_id"]) for row in rows for e in row.samples})) + "\n")
        collated_file.flush()
        pending.append([{"group_id": int(example["group_id"]), "model_version": example.get("model_version"),
                         "pulled_at": example.get("pulled_at"),
                         "input_ids": example["input_ids"], "completion_mask": example["completion_mask"]}
                        for row in rows for example in row.samples])
        return batch

    module.RolloutQueueDataset.__iter__ = iterate
    module.DataCollatorForRollout.torch_call = torch_call


class Probe:
    """The server's log-probs of fixed token sequences against a plain transformers copy of the trainer's weights."""

    def __init__(self, url, model_dir, tokenizer):
        from transformers import AutoModelForCausalLM

        self.url, self.model_name = url, str(model_dir)
        self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.sequences = [
            tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_dict=False) + tokenizer.encode(answer, add_special_tokens=False)
            for prompt, answer in PROBE_TEXTS]
        self.initial = self._reference_logps()

    @torch.no_grad()
    def _reference_logps(self):
        out = []
        for sequence in self.sequences:
            ids = torch.tensor([sequence])
            logps = torch.log_softmax(self.reference(ids).logits.float()[0, :-1], dim=-1)
            out.append(logps.gather(-1, ids[0, 1:, None])[:, 0])
        return torch.cat(out)

    def _server_logps(self):
        out = []
        for sequence in self.sequences:
            answer = requests.post(f"{self.url}/v1/completions", timeout=120, json={
                "model": self.model_name, "prompt": sequence, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0})
            if not answer.ok or "choices" not in answer.json():  # the server's own words, not a KeyError below
                raise RuntimeError(f"the vLLM server answered /v1/completions with HTTP {answer.status_code}: "
                                   f"{answer.text[:2000]}")
            prompt_logprobs = answer.json()["choices"][0]["prompt_logprobs"]  # None first (no context)
            out += [entry[str(token)]["logprob"] for entry, token in zip(prompt_logprobs[1:], sequence[1:])]
        return torch.tensor(out)

    def __call__(self, model):
        self.reference.load_state_dict(model.state_dict())
        trainer, server = self._reference_logps(), self._server_logps()
        return {"max_gap": float((server - trainer).abs().max()), "mean_gap": float((server - trainer).abs().mean()),
                "server_from_initial": float((server - self.initial).abs().mean()),
                "trainer_from_initial": float((trainer - self.initial).abs().mean()), "tokens": len(server)}


def main():
    out_dir = Path(sys.argv[1])
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    from support import async_stand_ins
    from support.async_weight_files import FileWeightTransfer
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    async_stand_ins.install()
    url, model_dir = options.pop("server"), str(options.pop("model_dir"))
    trainer_name = options.pop("trainer", "trl")
    transfer_kind = options.pop("transfer", "files")
    probe_on = options.pop("probe", False)
    queued_before_transfer = options.pop("queued_before_transfer", False)
    resume = options.pop("resume", False)
    summary_on = options.pop("summary", False)
    if trainer_name == "gspo":
        from trl_gspo import AsyncGSPOConfig as config_cls
        from trl_gspo import AsyncGSPOTrainer as trainer_cls
    else:
        config_cls, trainer_cls = AsyncGRPOConfig, AsyncGRPOTrainer
        if "loss_type" in options:
            raise ValueError("loss_type is an AsyncGSPOConfig field: use trainer 'gspo'")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt_text(i)}]
                                            for i in range(NUM_PROMPTS)]})
    prompt_index = {prompt_text(i): i for i in range(NUM_PROMPTS)}
    config = dict(output_dir=str(out_dir), use_cpu=True, report_to="none", logging_steps=1, max_steps=4,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, token_budget=0,
                  learning_rate=5e-2, weight_sync_steps=1, max_staleness=4, save_strategy="no", seed=0,
                  vllm_server_base_url=url, dataloader_pin_memory=False, queue_maxsize=16)
    if "save_steps" in options:
        config["save_strategy"] = "steps"
    config.update(options)
    args = config_cls(**config)

    pending = collections.deque()
    install_taps(pending, open(out_dir / "collated.jsonl", "a"))
    trained, probes = [], []
    steps_file = open(out_dir / "steps.jsonl", "a")

    def prompt_of(record):
        prefix = [t for t, m in zip(record["input_ids"].tolist(), record["completion_mask"].tolist()) if not m]
        text = tokenizer.decode(prefix, skip_special_tokens=True).strip()
        return prompt_index.get(text, text)

    class Trainer(trainer_cls):
        def training_step(self, model, inputs, num_items_in_batch=None):
            samples = pending.popleft()
            trained.append({"version": self.model_version, "step": self.state.global_step + 1,
                            "samples": [(s["group_id"], s["model_version"], prompt_of(s)) for s in samples],
                            "pulled_at": [s["pulled_at"] for s in samples]})
            return super().training_step(model, inputs, num_items_in_batch)

    transfer = FileWeightTransfer(url, skip_after=1 if transfer_kind == "cold_only" else None)
    trainer = Trainer(model=model_dir, reward_funcs=[digit_fraction], args=args, train_dataset=dataset,
                      processing_class=tokenizer, weight_transfer=transfer)
    trainer.rollout_queue = VersionTap(trainer.rollout_queue)
    probe = Probe(url, model_dir, tokenizer) if probe_on else None

    class Record(TrainerCallback):  # added after TRL's callbacks: runs after its weight sync of the same event
        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.monotonic()
            if probe:
                probes.append({"step": state.global_step, "version": trainer.model_version,
                               **probe(trainer.accelerator.unwrap_model(trainer.model))})

        def on_step_end(self, args, state, control, **kwargs):
            if probe:
                probes.append({"step": state.global_step, "version": trainer.model_version,
                               **probe(trainer.accelerator.unwrap_model(trainer.model))})
            mine = [t for t in trained if t["step"] == state.global_step]
            steps_file.write(json.dumps({"step": state.global_step, "version": trainer.model_version,
                                         "trained": mine, "seconds": time.monotonic() - self.started}) + "\n")
            steps_file.flush()

        def on_optimizer_step(self, args, state, control, **kwargs):  # before any callback's on_step_end: the transfer
            deadline = time.monotonic() + 120
            while queued_before_transfer and trainer.rollout_queue.qsize() < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("the rollout worker queued no sample in 120 s")
                time.sleep(0.05)

        def on_save(self, args, state, control, **kwargs):
            print(f"SAVED {state.global_step}", flush=True)

    trainer.add_callback(Record())
    report = None
    if summary_on:
        from trl_gspo.launch.reporting import RunReportCallback

        report = RunReportCallback(plot=False, deferred=True)
        trainer.add_callback(report)
    start_state = None
    if resume:
        from transformers.trainer_utils import get_last_checkpoint

        checkpoint = get_last_checkpoint(str(out_dir))
        start_state = json.loads((Path(checkpoint) / "rollout_state.json").read_text())
        trainer.train(resume_from_checkpoint=checkpoint)
    else:
        trainer.train()
    summary = None
    if report is not None:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            report.print_summary()
        summary = printed.getvalue()
        print(summary, flush=True)
    result = {
        "summary": summary, "log_history": trainer.state.log_history, "global_step": trainer.state.global_step,
        "model_version": trainer.model_version, "probes": probes, "trained": trained,
        "transfers": transfer.log, "prefix_cache_resets": transfer.prefix_cache_resets,
        "dataset_start_index": trainer.rollout_worker._loop_kwargs["dataset_start_index"],
        "start_state": start_state, "seconds": time.monotonic() - started,
    }
    (out_dir / "result.json").write_text(json.dumps(result))
    print("RESULT " + json.dumps(result), flush=True)
    # TRL stopped its rollout worker when training ended; the process ends without waiting for anything else
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
