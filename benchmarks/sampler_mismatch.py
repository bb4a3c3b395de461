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

Last line, exactly: `sampler_route_agreement: plain <p> r2 <q> r3 <r>`.
"""

from __future__ import annotations

import argparse
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


def routing_table(model, tokenizer, rollouts: int, prompts: int, group: int, lr: float, seed: int) -> dict:
    """Route agreement with the sampler and the mismatch, per arm, over the training passes of off-policy
    mini-batches (the model is updated with token-level GRPO between them, natural routing)."""
    from trl_gspo.routing import RoutingReplay
    from trl_gspo.routing.rollout import has_route

    trainer = copy.deepcopy(model).float()
    sampler = copy.deepcopy(model).to(torch.bfloat16)
    sampler_routing = RoutingReplay(sampler)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=lr)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # per (arm, phase): route sets equal, (token, layer) pairs, sum |log r_t|, tokens, sequences outside, sequences
    totals = {(arm, phase): [0.0] * 6 for arm in ("plain", "r2", "r3") for phase in ("on-policy", "off-policy")}
    for _ in range(rollouts):
        batch = sample(sampler, sampler_routing, tokenizer, rng, prompts, group)
        trainer.eval()
        old_logps, old_routes = used_routes(trainer, batch, slice(None))
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
            trainer.train()
            loss, _ = _loss("grpo", _setup.token_logps(trainer, batch, rows), old_logps[rows], batch["advantages"][rows],
                            mask.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        sampler.load_state_dict({k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()})  # weight sync
    table = {key: dict(agreement=same / pairs, abs_log_ratio=abs_log_r / tokens, seq_outside_band=outside / seqs)
             for key, (same, pairs, abs_log_r, tokens, outside, seqs) in totals.items()}
    for arm in ("plain", "r2", "r3"):  # every training pass
        same, pairs = (totals[arm, "on-policy"][k] + totals[arm, "off-policy"][k] for k in (0, 1))
        table[arm, "all"] = dict(table[arm, "off-policy"], agreement=same / pairs)
    return table


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    if args.quick:
        overrides, pretrain_steps, seeds, rollouts, prompts, group = _setup.QUICK_MODEL, 20, 1, 2, 4, 4
    else:
        overrides = _setup.MODELS[(32, 4)] if args.size == "cpu" else GPU_MODEL
        pretrain_steps, seeds, rollouts, prompts, group = 300, args.seeds, args.rollouts, 8, 8
    started = time.perf_counter()
    _setup.header("sampler_mismatch", args.device, "bfloat16 sampler / float32 trainer",
                  overrides["experts_implementation"])
    tokenizer = build_tokenizer()
    model = _setup.pretrain(overrides, pretrain_steps, args.cache, print, device=args.device)
    print(f"{overrides['num_experts']} experts top-{overrides['num_experts_per_tok']}, "
          f"{overrides['num_hidden_layers']} layers; {seeds} seed(s), {prompts} prompts x {group} samples per rollout")

    per_seed = [routing_table(model, tokenizer, max(1, rollouts // 4), prompts, group, args.lr, seed)
                for seed in range(seeds)]
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
    summary = {arm: statistics.median(s[arm, "all"]["agreement"] for s in per_seed) for arm in ("plain", "r2", "r3")}

    print("\n| loss | replay | seed | reward first -> last third | mean abs log(pi_old/pi_sampler) |\n|---|---|---|---|---|")
    for loss in ("grpo", "gspo"):
        for replay in ("r2", "r3"):
            for seed in range(seeds):
                r = train(model, tokenizer, loss, replay, rollouts, prompts, group, args.lr, seed)
                print(f"| {loss} | {replay} | {seed} | {r['first']:.3f} -> {r['last']:.3f} | {r['abs_log_r']:.4g} |",
                      flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    print(f"sampler_route_agreement: plain {summary['plain']:.4f} r2 {summary['r2']:.4f} r3 {summary['r3']:.4f}")


if __name__ == "__main__":
    main()
