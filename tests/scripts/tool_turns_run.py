"""TRL's tool loop on one or two processes with rank-divergent turns, for tests/test_tool_turns.py.

    tool_turns_run.py OUT_DIR '{"trainer": "gspo", "loss_type": "gspo", "routing_replay": "sampler", ...}'

Run under `accelerate launch` (DDP, ZeRO-2, ZeRO-3; one or two processes), with HF generate, TRL's colocate vLLM
engine (tensor-parallel 1 or 2) or a `trl-gspo vllm-serve` server. The model is the cold-started tool model of
trl_gspo/quickstart/tools.py (TRL_GSPO_VLLM_MODEL_DIR, built by the test), the tool is its calculator `add`.

Rank-divergent tool loops, forced. Prompts are "add A B"; whether a sample calls the tool in a turn is decided from
its prompt by wrapping TRL's `parse_response` (tests/support/tool_turn_runs.py):

    A % 3 == 0   a call in turns 1 and 2 (two tool turns: max_tool_calling_iterations is 2)
    A % 3 == 1   a call in turn 1 only
    A % 3 == 2   no call

The dataset is unshuffled and each rank takes two groups (two prompts) per round, in order: rank 0's prompts are of
the first kind, rank 1's are one of each other kind in round 1 and of the last kind in round 2. So rank 0 has two
tool turns of 8 samples per round, and rank 1 one turn of 4 samples (round 1) or none (round 2). The RESULT reports
every rank's turns, so the test checks that the divergence happened.

Options (JSON): config overrides, plus
    trainer     "gspo" (GSPOTrainer, GSPOConfig) or "stock" (TRL's GRPOTrainer and GRPOConfig: what TRL does)
    engine      "hf" (default), "colocate" or "server" (then `server`: its URL; TRL's NCCL weight sync is stubbed, so
                use learning_rate 0)
    reference   with vLLM and R3: every policy pass is checked against routes laid out by hand from the raw engine
                outputs (vllm_run.install_reference); the colocate engine serves perturbed routers (sync stubbed)
    hang_after  seconds of training after which every rank writes its threads' stacks to OUT_DIR/stacks_rank<R>.txt
                and, HANG_EXIT_GRACE seconds later, exits (faulthandler): bounds a hang of stock TRL and shows where
                each rank waits (a file per rank: two ranks dumping into one pipe at once interleave their lines)

Checks, gathered from every rank into one `RESULT {json}` line (rank 0):
    own_history  every model segment of every sample (a run of tool_mask 1) was produced by a generate call whose
                 prompt was exactly the sample's tokens before the segment (the ground truth: HF generate's rows, the
                 engine's RequestOutputs or the server's choices): every completion continues its own history
    turns        per rank and round: [tool turns of the rank's busiest sample, samples that called a tool in turn 1]
    FOREIGN      (vLLM, printed by the rank at once) TRL's generate returned completions of prompts this rank did not
                 send in those positions

With HF generate, the completions are forced too: each token is drawn by a key of (the row's prompt, its place among
identical rows of the call, the step), never from the logits, and eos ends a turn after 2-8 tokens. One process and
two then generate the same completions on any machine, so their losses and gradients can be compared: sampling from
the logits would not do, since calls batched differently give logits that differ by rounding, and a near-tie token
flips on some CPUs. The model still scores every token (its log-probs, R3's routes, the losses).
"""

import copy
import json
import os
import random
import sys
import zlib
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "scripts"))
from support.helpers import tiny_config  # noqa: E402
from support.tool_turn_runs import forced_calls  # noqa: E402
from support.vllm_servers import completions_choices  # noqa: E402

try:  # skip DeepSpeed's JIT build of a shared-memory op that gloo on CPU does not need
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
except ImportError:
    pass

CALLS_BY_KIND = {0: 2, 1: 1, 2: 0}  # A % 3 -> the number of tool turns
HANG_EXIT_GRACE = 15  # seconds between a hung rank's stack dump and its exit (`hang_after`)


def divergent_dataset(rounds: int):
    """Four prompts per round: two for rank 0 (two tool turns), two for rank 1 (one turn and none, then none twice)."""
    from datasets import Dataset

    values = []
    for r in range(rounds):
        values += [3 * (2 * r + 1), 3 * (2 * r + 2), 3 * r + (1 if r % 2 == 0 else 2), 3 * r + 2]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"add {a} {i % 7}"}]
                                         for i, a in enumerate(values)]})


def distinct_characters(completions, **kwargs):
    """Varies within a group from the first step: distinct characters over all of a completion's messages."""
    return [float(len(set("".join(str(m.get("content") or "") for m in messages)))) for messages in completions]


class KeyedChoice:
    """A logits processor forcing each row's next token from (row key, step): a plain character, then eos after a
    keyed length of 2-8 tokens."""

    def __init__(self, keys, start, plain_ids, eos_token_id):
        self.keys, self.start, self.plain, self.eos = keys, start, plain_ids, eos_token_id

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, float("-inf"))
        for row, key in enumerate(self.keys):
            draw = random.Random(key * 4096 + step)
            forced[row, self.eos if step >= 2 + key % 7 else draw.choice(self.plain)] = 0.0
        return forced


def keyed_hf_generate(model, tokenizer, calls):
    """`model.generate` with keyed completions (module docstring); each row's prompt and kept tokens go into
    `calls`."""
    from transformers import LogitsProcessorList

    generate = model.generate
    vocab, eos = tokenizer.get_vocab(), tokenizer.eos_token_id
    plain = [vocab[ch] for ch in "0123456789abcdefghijklmnopqrstuvwxyz" if ch in vocab]

    def keyed(input_ids, attention_mask, generation_config, **kwargs):
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        seen, keys = {}, []
        for prompt in prompts:
            crc = zlib.crc32(bytes(str(prompt), "ascii"))
            keys.append(crc * 64 + seen.get(crc, 0))
            seen[crc] = seen.get(crc, 0) + 1
        greedy = copy.deepcopy(generation_config)
        greedy.do_sample, greedy.temperature, greedy.top_k, greedy.top_p = False, None, None, None
        out = generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=greedy,
                       logits_processor=LogitsProcessorList([KeyedChoice(keys, input_ids.shape[1], plain, eos)]),
                       **kwargs)
        sequences = out if torch.is_tensor(out) else out.sequences
        for prompt, row in zip(prompts, sequences[:, input_ids.shape[1]:].tolist()):
            calls.append((prompt, row[:row.index(eos) + 1] if eos in row else row))
        return out

    model.generate = keyed


def keep_engine_calls(trainer, engine, calls):
    """vLLM's raw (prompt, completion) pairs: the colocate engine's RequestOutputs (a TP rank sees its whole group's),
    or the server's choices (the main process only)."""
    if engine == "colocate":
        llm = trainer.vllm_generation.llm
        generate = llm.generate

        def keeping(*a, **k):
            result = generate(*a, **k)
            calls.extend((list(r.prompt_token_ids), list(o.token_ids)) for r in result for o in r.outputs)
            return result

        llm.generate = keeping
        return
    client = getattr(trainer.vllm_generation, "vllm_client", None)
    if client is None:
        return
    post = client.session.post

    def keeping_post(url, *a, **k):
        response = post(url, *a, **k)
        if str(url).endswith("/v1/completions") and response.ok:
            calls.extend((list(c["prompt_token_ids"]), list(c["token_ids"])) for c in answer_choices(response))
        return response

    client.session.post = keeping_post


def answer_choices(response):
    """The choices of a /v1/completions answer: vLLM's JSON, or trl-gspo's route frame (a safetensors file whose
    `answer` tensor holds the JSON answer; its routes this script does not need). Reads `response.content`, which the
    trainer's capture then reads again."""
    body = response.content
    if response.headers.get("content-type", "").startswith("application/x-trl-gspo-routes"):
        from safetensors.numpy import load

        return completions_choices(json.loads(load(body)["answer"].tobytes()), response.status_code)
    return completions_choices(json.loads(body), response.status_code)


def report_foreign_completions(trainer):
    """Print at once (it must survive a later hang) when TRL's vLLM generate hands this rank completions whose prompt
    is not the one this rank sent in that position: TRL returns each completion's prompt ids, sliced like it."""
    generation, rank = trainer.vllm_generation, trainer.accelerator.process_index
    generate = generation.generate

    def checking(*a, **k):
        result = generate(*a, **k)
        sent = k["prompts"] if "prompts" in k else a[0]
        foreign = sum(list(got) != list(mine) for got, mine in zip(result[0], sent))
        if foreign:
            print(f"FOREIGN rank {rank}: {foreign} of {len(sent)} completions came from other prompts", flush=True)
        return result

    generation.generate = checking


def keep_samples(trainer, samples):
    """Every round's final samples on this rank: (prompt ids, completion ids, tool_mask)."""
    generate = trainer._generate

    def keeping(prompts):
        output = generate(prompts)
        prompt_ids, completion_ids, tool_mask = output[0], output[1], output[2]
        masks = tool_mask if tool_mask is not None else [[1] * len(c) for c in completion_ids]
        samples.append([(list(p), list(c), list(m)) for p, c, m in zip(prompt_ids, completion_ids, masks)])
        return output

    trainer._generate = keeping


def segments(mask):
    """(start, end) of each run of ones in a tool_mask."""
    runs, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    return runs


def own_history_violations(rounds, calls):
    """Samples with a model segment that no generate call produced from the sample's own history (module docstring)."""
    produced = {}
    for prompt, completion in calls:
        produced.setdefault(tuple(prompt), []).append(tuple(completion))
    bad = 0
    for round_ in rounds:
        for prompt, completion, mask in round_:
            for start, end in segments(mask):
                history, segment = tuple(prompt + completion[:start]), tuple(completion[start:end])
                last = end == len(completion)  # TRL trims only the last turn (max_completion_length)
                if not any(out[:len(segment)] == segment and (last or len(out) == len(segment))
                           for out in produced.get(history, [])):
                    bad += 1
                    break
    return bad


def turns(rounds):
    """Per round: [tool turns of the busiest sample, samples with a tool result in turn 1]."""
    out = []
    for round_ in rounds:
        results = [len(segments([1 - bit for bit in mask])) for _, _, mask in round_]
        out.append([max(results, default=0), sum(r > 0 for r in results)])
    return out


def main():
    out_dir = Path(sys.argv[1])
    options = json.loads(sys.argv[2])
    trainer_kind, engine = options.pop("trainer", "gspo"), options.pop("engine", "hf")
    server, reference = options.pop("server", None), options.pop("reference", False)
    hang_after = options.pop("hang_after", None)
    torch.set_num_threads(1)

    import trl.trainer.grpo_trainer as grpo_trainer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    grpo_trainer.parse_response = forced_calls(grpo_trainer.parse_response, lambda a: CALLS_BY_KIND[a % 3])
    weight_syncs = []
    if engine != "hf":
        from support import vllm_cpu_engine

        vllm_cpu_engine.install()
    if engine == "server":  # NCCL-only in TRL 1.16: no weight transfer between CPU processes (learning rate 0)
        from trl.generation.vllm_client import VLLMClient

        VLLMClient.init_communicator = lambda self, *a, **k: None
        VLLMClient.update_named_params = lambda self, metadata, params: weight_syncs.append(len(list(params)))

    from trl_gspo.quickstart.tools import add

    model_dir = Path(os.environ["TRL_GSPO_VLLM_MODEL_DIR"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    max_steps = options.pop("max_steps", 2)
    config = dict(per_device_train_batch_size=16 // world_size, num_generations=4, max_steps=max_steps,
                  shuffle_dataset=False, steps_per_generation=1, max_completion_length=128,
                  max_tool_calling_iterations=2,
                  learning_rate=2e-3, num_iterations=2, ddp_backend="gloo" if world_size > 1 else None,
                  router_aux_loss_coef=0.0, logging_steps=1)
    if engine != "hf":
        config.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False, vllm_max_model_length=256)
    if engine == "server":
        config.update(vllm_mode="server", vllm_server_base_url=server)
    config.update(options)
    if trainer_kind == "stock":
        from trl import GRPOConfig, GRPOTrainer

        args, trainer_cls = tiny_config(out_dir, config_cls=GRPOConfig, **config), GRPOTrainer
    else:
        from trl_gspo import GSPOTrainer

        args, trainer_cls = tiny_config(out_dir, **config), GSPOTrainer
    if reference and engine == "colocate":  # the engine routes otherwise than the trainer's natural routing
        from vllm_run import perturbed_router_copy

        model.name_or_path = str(perturbed_router_copy(model_dir, out_dir / "perturbed_routers"))
    calls, samples = [], []
    if engine == "hf":
        keyed_hf_generate(model, tokenizer, calls)
    trainer = trainer_cls(model, distinct_characters, args=args, processing_class=tokenizer,
                          train_dataset=divergent_dataset(max_steps), tools=[add])
    if reference and engine == "colocate":
        trainer.vllm_generation.sync_weights = lambda: weight_syncs.append(0)
    if engine != "hf":
        keep_engine_calls(trainer, engine, calls)
        report_foreign_completions(trainer)
    keep_samples(trainer, samples)
    checks = {"passes": 0, "max_forced_diff": 0.0, "max_natural_diff": 0.0, "training_passes": 0}
    if reference:
        from vllm_run import install_reference

        install_reference(trainer, args, checks, server=engine == "server")

    if hang_after:
        import faulthandler

        out_dir.mkdir(parents=True, exist_ok=True)
        stacks = open(out_dir / f"stacks_rank{os.environ.get('RANK', '0')}.txt", "w")  # open until the process ends
        # Every rank dumps at hang_after and exits HANG_EXIT_GRACE seconds later: a rank that exited at once could end
        # the other (its collective fails, or the launcher stops the group) before that rank's own dump.
        faulthandler.dump_traceback_later(hang_after, exit=False, file=stacks)
        import threading

        exit_timer = threading.Timer(hang_after + HANG_EXIT_GRACE, os._exit, (1,))
        exit_timer.daemon = True
        exit_timer.start()
    trainer.train()
    if hang_after:
        faulthandler.cancel_dump_traceback_later()
        exit_timer.cancel()
    from accelerate.utils import gather_object

    every_call = gather_object(calls)  # server mode: the main process's; colocate: each rank's engine's
    every_rank = gather_object([{"turns": turns(samples), "samples": samples, "checks": checks}])
    if trainer.accelerator.is_main_process:
        history = [h for h in trainer.state.log_history if "loss" in h]
        print("RESULT " + json.dumps({
            "world_size": trainer.accelerator.num_processes,
            "turns": [rank["turns"] for rank in every_rank],
            "own_history_violations": [own_history_violations(rank["samples"], every_call) for rank in every_rank],
            "samples_checked": [sum(len(r) for r in rank["samples"]) for rank in every_rank],
            "checks_per_rank": [rank["checks"] for rank in every_rank],
            "loss": [h["loss"] for h in history], "grad_norm": [h.get("grad_norm") for h in history],
            "reward": [h.get("reward") for h in history],
            "call_frequency": [h.get("tools/call_frequency") for h in history],
        }), flush=True)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown: gloo and vLLM's CPU workers have aborted a finished run at exit
    # (tests/scripts/multiprocess_run.py and vllm_run.py say how).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
