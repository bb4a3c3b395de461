"""A GSPOTrainer run in vLLM server mode on two processes, against a stand-in server on the main process (TRL's own
`VLLMGeneration` sync and generate code, its broadcast of the server's answer to the other ranks, and the trainer's
`_sync_weights_together` / `_server_guards`), with one failure injected on the main process only:

- `--fail lora-sync`: LoRA on the fused experts; building one `W + delta` for the weight sync before step 2 fails.
- `--fail server-request`: the server refuses the connection at step 2's generation request.

Every rank must stop with the same error, at once, rather than wait in TRL's next collective. Each rank writes
OUT_DIR/rank<r>.json: the error's class and message, its cause's class, and the seconds from the failure on the main
process to the raise on this rank (the ranks share one clock). Checkpoints are saved every step.

    accelerate launch --config_file recipes/accelerate/cpu_ddp.yaml --num_processes 2 rank_failure_run.py OUT_DIR \
        --fail lora-sync|server-request
"""

import argparse
import contextlib
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.helpers import digit_reward, tiny_config, toy_dataset  # noqa: E402

import trl_gspo.lora_merge as lora_merge  # noqa: E402
from trl_gspo import GSPOTrainer  # noqa: E402
from trl_gspo.quickstart.model import build_model  # noqa: E402
from trl_gspo.quickstart.tokenizer import build_tokenizer  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out_dir", type=Path)
parser.add_argument("--fail", choices=["lora-sync", "server-request"], required=True)
cli = parser.parse_args()
torch.set_num_threads(1)
failed_at = cli.out_dir / "failed_at"  # the main process's clock when it failed


class StandInServer:
    """The main process's `VLLMClient`: completions of fixed random tokens, a packed weight transfer that takes
    every tensor, and, with `--fail server-request`, a refused connection at its second generation request."""

    def __init__(self, vocab: int):
        self.base_url, self.requests, self.vocab = "http://127.0.0.1:1", 0, vocab
        self.session = types.SimpleNamespace(post=None)  # the stall watch wraps it; nothing here posts
        self.received = 0

    def generate(self, prompts, n, max_tokens, **_):
        self.requests += 1
        if cli.fail == "server-request" and self.requests == 2:
            import requests

            failed_at.write_text(repr(time.time()))
            raise requests.exceptions.ConnectionError("connection refused (stand-in)")
        generator = torch.Generator().manual_seed(self.requests)
        completions = [torch.randint(3, self.vocab, (max_tokens,), generator=generator).tolist()
                       for _ in range(len(prompts) * n)]
        return {"prompt_ids": prompts, "completion_ids": completions,
                "logprobs": [[[-2.0]] * len(ids) for ids in completions], "logprob_token_ids": None}

    def update_named_params(self, metadata, named_params):
        self.received = sum(1 for _ in named_params)
        assert self.received == len(metadata)

    def reset_prefix_cache(self):
        pass


def serve(trainer, tokenizer) -> None:
    """Turn the HF-generate trainer into a server-mode one: TRL's `VLLMGeneration`, set up as its server mode would
    be, with the stand-in client on the main process."""
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration.__new__(VLLMGeneration)
    args = trainer.args
    vars(generation).update(
        model=trainer.accelerator.unwrap_model(trainer.model), accelerator=trainer.accelerator, mode="server",
        enable_sleep_mode=False, _weight_metadata=None, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        max_completion_length=args.max_completion_length, logprobs=0, structured_outputs_regex=None,
        generation_kwargs={}, _dist=types.SimpleNamespace(gather_params=lambda params: contextlib.nullcontext(),
                                                          is_fsdp=False))
    if trainer.accelerator.is_main_process:
        generation.vllm_client = StandInServer(len(tokenizer))
    trainer.vllm_generation, trainer.use_vllm, trainer.vllm_mode = generation, True, "server"
    trainer._last_loaded_step = 0
    trainer.vllm_importance_sampling_correction = False
    if trainer._lora is not None:  # what TrainerLora.build installs when the trainer uses vLLM
        trainer._lora._install_exact_sync()
    agreed_server_sync(trainer)


def main():
    from peft import LoraConfig

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0)
    args = tiny_config(cli.out_dir, loss_type="gspo", max_steps=3, per_device_train_batch_size=4,
                       ddp_backend="gloo", save_strategy="steps", save_steps=1,
                       steps_per_generation=1)  # a rollout, so a weight sync, per step
    lora = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = GSPOTrainer(model, digit_reward, args=args, train_dataset=toy_dataset(), processing_class=tokenizer,
                          peft_config=lora if cli.fail == "lora-sync" else None)
    serve(trainer, tokenizer)
    rank = trainer.accelerator.process_index
    if cli.fail == "lora-sync" and rank == 0:
        original, builds = lora_merge.effective_weight, []

        def failing(target):
            builds.append(target)
            if len(builds) == 2:
                failed_at.write_text(repr(time.time()))
                raise RuntimeError("out of memory (stand-in)")
            return original(target)

        lora_merge.effective_weight = failing
    report = {"error": None}
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001 - reported to the test
        cause = error.__cause__
        report = {"error": type(error).__name__, "message": str(error),
                  "cause": type(cause).__name__ if cause is not None else None,
                  "seconds_after_failure": time.time() - float(failed_at.read_text())}
    (cli.out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    sys.exit(1 if report["error"] else 0)


if __name__ == "__main__":
    main()
