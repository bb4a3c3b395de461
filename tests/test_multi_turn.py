"""GSPO, GSPO-token and grpo inside TRL's own tool loop (`tools=` and `environment_factory=`), with the tiny MoE
cold-started to call a calculator (trl_gspo/quickstart/tools.py), on HF generate.

- The loss of every training pass equals a float64 reference written from the paper over the policy's own tokens
  (tool results masked): sequence ratio s_i, length |y_i|, the clip; and differs from the same formula with the
  tool tokens counted, so the mask is really applied.
- R3 across turns: every policy pass (TRL's old-policy pass and each training pass) equals a model copy scored with
  routes built independently of trl_gspo's recording and stitching: each call's routers are perturbed differently
  (so the calls route differently), the copy re-runs each turn's forward with that turn's perturbation, and each
  token takes the route of the first turn whose forward fed it. Natural routing, and the "last call" rule, differ.
- A rollout_func returning `routed_experts` gets them replayed, validated like vLLM's.
"""

import contextlib
import math

import pytest
import torch
from support.helpers import tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_gspo import GSPOTrainer
from trl_gspo.quickstart.tools import CalculatorEnv, add, make_tool_rl_dataset, tool_answer_reward
from trl_gspo.routing import RoutingReplay

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

EPS_LOW, EPS_HIGH = 3e-4, 4e-4




def _varied_reward(completions, **kwargs):
    """A reward that varies within every group (the tiny model rarely gets the sum right): the number of messages
    plus the length of the last one, so advantages are non-zero and the loss checks below can fail."""
    return [len(messages) + 0.1 * len(str(messages[-1].get("content") or "")) for messages in completions]


def _trainer(model_dir, out, environment=False, rollout_func=None, **config):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    options = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
                   steps_per_generation=2, max_steps=4, learning_rate=2e-3, max_tool_calling_iterations=2,
                   temperature=1.0)
    options.update(config)
    tools = {"environment_factory": CalculatorEnv} if environment else {"tools": [add]}
    if rollout_func is not None:
        tools = {"rollout_func": rollout_func}
    return GSPOTrainer(model, [tool_answer_reward, _varied_reward], args=tiny_config(out, **options),
                       processing_class=tokenizer,
                       train_dataset=make_tool_rl_dataset(32, seed=1), **tools)


def _keep_rollouts(trainer, reference=False):
    """TRL's unpadded rollout of each round (`_generate`'s prompt ids, completion ids and tool mask), kept in order.
    `reference`: also each sample's reference routes by both rules (`_reference_routes`), computed right after the
    rollout, on a copy of the weights that sampled it."""
    rounds, generate = [], trainer._generate

    def keeping(prompts):
        output = generate(prompts)
        rollout = {"prompt_ids": output[0], "completion_ids": output[1], "tool_mask": output[2]}
        if reference:
            copy_ = _copy(trainer)
            rollout["routes"] = [{rule: _reference_routes(copy_, list(p), list(c), mask, rule) for rule in RULES}
                                 for p, c, mask in zip(*rollout.values())]
        rounds.append(rollout)
        return output

    trainer._generate = keeping
    return rounds


def _sample_of(rollout, prompt, completion):
    """The index of a sample of the rollout with exactly these tokens (identical samples are interchangeable)."""
    for i, (p, c) in enumerate(zip(rollout["prompt_ids"], rollout["completion_ids"])):
        if list(p) == prompt and list(c) == completion:
            return i
    raise AssertionError("a scored row matches no sample of the round")


def _reference(logps, old_logps, advantages, mask, eps_low, eps_high):
    """GSPO (arXiv 2507.18071 eq. 5-7) in float64: J = mean_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i),
    s_i = exp(mean over the policy's tokens of log pi/pi_old); returns the loss -J, mean s_i and the share of
    sequences whose objective the clip binds."""
    logps, old_logps, mask = logps.double(), old_logps.double(), mask.double()
    length = mask.sum(-1)  # |y_i|: the policy's tokens only
    s = torch.exp(((logps - old_logps) * mask).sum(-1) / length)
    a = advantages.double()
    objective = torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)
    clipped = ((s < 1 - eps_low) & (a < 0)) | ((s > 1 + eps_high) & (a > 0))
    return -objective.mean(), s.mean(), clipped.double().mean()


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token", "grpo"])
def test_tool_loop_trains_with_every_loss_type(loss_type, tool_model_dir, tmp_path):
    trainer = _trainer(tool_model_dir, tmp_path, loss_type=loss_type, max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logs and logs[0]["tools/call_frequency"] > 0.5  # the cold-started model calls the tool
    assert logs[0]["tools/turns_mean"] > 1.0 and logs[0]["tools/turns_max"] >= 2
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


@pytest.mark.parametrize("environment, band", [(False, (EPS_LOW, EPS_HIGH)), (True, (0.99, 100.0))])
def test_gspo_loss_counts_only_the_policys_tokens(environment, band, tool_model_dir, tmp_path):
    """Every training pass's loss, logged mean ratio and clipped share equal the float64 reference over
    completion_mask * tool_mask, on off-policy mini-batches too (2 per rollout batch). In the paper's band almost
    every off-policy sequence is clipped (the loss then no longer depends on s_i); a band that clips nothing shows the
    tool tokens are really left out of s_i and |y_i|: counting them gives another loss."""
    trainer = _trainer(tool_model_dir, tmp_path, environment=environment, loss_type="gspo", epsilon=band[0],
                       epsilon_high=band[1])
    trainer.aux_loss_enabled = False  # the loss is then the policy loss alone (the MoE aux loss is TRL's, tested there)
    seen, compute_loss = [], trainer._compute_loss
    scoring = trainer._get_per_token_logps_and_entropies

    def scored(*args, **kwargs):  # the training pass of the micro-batch whose loss is being computed
        result = scoring(*args, **kwargs)
        if seen and "logps" not in seen[-1] and torch.is_grad_enabled():
            seen[-1]["logps"] = result[0].detach()
        return result

    def computing(model, inputs):
        seen.append({"inputs": inputs})
        loss = compute_loss(model, inputs)
        seen[-1]["loss"] = loss.detach()
        return loss

    trainer._compute_loss, trainer._get_per_token_logps_and_entropies = computing, scored
    trainer.train()
    steps = [h for h in trainer.state.log_history if "gspo/ratio_mean" in h]
    assert len(steps) == len(seen) == 4  # logging_steps=1, one micro-batch per step
    tool_tokens_moved_the_loss = 0
    for entry, logged in zip(seen, steps):
        inputs = entry["inputs"]
        policy = inputs["completion_mask"] * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        old = entry["logps"] if old is None else old
        loss, ratio, clipped = _reference(entry["logps"], old, inputs["advantages"], policy, *band)
        assert entry["loss"].double().item() == pytest.approx(loss.item(), abs=1e-6)
        assert logged["gspo/ratio_mean"] == pytest.approx(ratio.item(), rel=1e-4)
        assert logged["clip_ratio/region_mean"] == pytest.approx(clipped.item(), abs=1e-6)
        counted, _, _ = _reference(entry["logps"], old, inputs["advantages"], inputs["completion_mask"], *band)
        tool_tokens_moved_the_loss += abs(counted.item() - loss.item()) > 1e-6
    assert any(bool((e["inputs"]["tool_mask"] == 0).any()) for e in seen)
    assert any(bool((e["inputs"]["advantages"] != 0).any()) for e in seen)
    if band[1] > 1:  # nothing clipped: s_i, and with it the loss, depends on which tokens count
        assert tool_tokens_moved_the_loss >= 1


# ---------------------------------------------------------------- R3 across turns, against an independent reference
ROUTER_NOISE = 0.5  # per-call router perturbation: large enough that turns route differently
RULES = ("first", "last")


def _copy(trainer):
    """A fresh model with the policy's current weights (not a deepcopy: that would copy the trainer's hooks)."""
    base = trainer.accelerator.unwrap_model(trainer.model)
    copy_ = type(base)(base.config).eval()
    copy_.load_state_dict(base.state_dict())
    return copy_


def _routers(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate")]


@contextlib.contextmanager
def _perturbed(model, call):
    """The model's routers shifted by a deterministic perturbation of the call's number within its round."""
    routers = _routers(model)
    saved = [r.weight.detach().clone() for r in routers]
    generator = torch.Generator().manual_seed(1000 + call)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(ROUTER_NOISE * r.weight.std() * torch.randn(r.weight.shape, generator=generator))
    try:
        yield
    finally:
        with torch.no_grad():
            for r, w in zip(routers, saved):
                r.weight.copy_(w)


def _perturb_each_generate_call(trainer):
    """Each HF generate call of a round runs with its own router perturbation (call 1, 2, ... of the round)."""
    base = trainer.accelerator.unwrap_model(trainer.model)
    generate, state = base.generate, {"call": 0}

    def perturbed_generate(*args, **kwargs):
        state["call"] += 1
        with _perturbed(base, state["call"]):
            return generate(*args, **kwargs)

    base.generate = perturbed_generate
    round_ = trainer._generate_and_score_completions

    def new_round(inputs):
        state["call"] = 0
        return round_(inputs)

    trainer._generate_and_score_completions = new_round


def _natural_routes(model, input_ids):
    """Top-k experts per token and MoE layer of one forward, from the routers' own outputs: `[seq, layers, k]`."""
    found = []
    handles = [r.register_forward_hook(lambda m, a, out: found.append(out[2].detach().clone()))
               for r in _routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([input_ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(found, dim=1)


def _turn_ends(tool_mask):
    """End (exclusive, in the completion) of each model turn: each run of 1s in the tool mask."""
    ends = [t for t in range(1, len(tool_mask) + 1)
            if tool_mask[t - 1] == 1 and (t == len(tool_mask) or tool_mask[t] == 0)]
    return ends


def _reference_routes(copy_, prompt, completion, tool_mask, rule):
    """Routes of `prompt | completion` by hand: call k of the round fed positions [0, P + end_k - 1) under its own
    router perturbation; "first": each position from the first call that fed it, "last": from the last."""
    tokens, width = prompt + completion, len(prompt)
    routes = None
    for call, end in enumerate(_turn_ends(tool_mask), start=1):
        fed = width + end - 1
        with _perturbed(copy_, call):
            turn = _natural_routes(copy_, tokens[:fed])
        if routes is None:
            routes = torch.full((len(tokens), *turn.shape[1:]), -1, dtype=torch.long)
        take = torch.arange(fed) if rule == "last" else torch.arange(fed)[(routes[:fed] < 0).all(-1).all(-1)]
        routes[take] = turn[take]
    return routes


def _checked_passes(trainer, rollouts):
    """Wrap the policy passes: each is compared with a model copy of the current weights scored with the round's
    reference routes ("first"), the "last" rule and natural routing; differences kept in `checks`."""
    checks = {"passes": 0, "training_passes": 0, "first": 0.0, "last": 0.0, "natural": 0.0}
    scoring = trainer._get_per_token_logps_and_entropies

    def checked(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        result = scoring(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if trainer.accelerator.unwrap_model(model) is not trainer.accelerator.unwrap_model(trainer.model):
            return result
        copy_ = _copy(trainer)
        replay, width = RoutingReplay(copy_), input_ids.shape[1] - logits_to_keep
        logps = result[0].detach()
        for rule in ("first", "last", None):
            worst = 0.0
            for row in range(input_ids.shape[0]):
                mask = attention_mask[row].bool()
                prompt = input_ids[row, :width][mask[:width]].tolist()
                completion = input_ids[row, width:][mask[width:]].tolist()
                rollout = rollouts[-1]
                sample = _sample_of(rollout, prompt, completion)
                ids = torch.tensor([prompt + completion])
                with torch.no_grad():
                    if rule is None:
                        logits = copy_(input_ids=ids).logits
                    else:
                        routes = rollout["routes"][sample][rule]
                        force = (routes >= 0).all(-1).all(-1)[None]
                        with replay.replay(routes.clamp(min=0)[None].to(torch.uint8), mask=force):
                            logits = copy_(input_ids=ids).logits
                logits = logits[0, len(prompt) - 1:-1].float() / trainer.temperature
                expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
                got = logps[row, :len(completion)]
                worst = max(worst, (expected - got).abs().max().item())
            key = rule or "natural"
            checks[key] = max(checks[key], worst)
        checks["passes"] += 1
        checks["training_passes"] += int(trainer.model.training and torch.is_grad_enabled())
        return result

    trainer._get_per_token_logps_and_entropies = checked
    return checks


@pytest.mark.parametrize("environment", [False, True])
def test_r3_across_turns_replays_the_routes_each_token_was_first_computed_with(environment, tool_model_dir,
                                                                               tmp_path):
    trainer = _trainer(tool_model_dir, tmp_path, environment=environment, loss_type="gspo_token",
                       routing_replay="sampler", routing_replay_min_agreement=0.0)
    _perturb_each_generate_call(trainer)
    rollouts = _keep_rollouts(trainer, reference=True)
    checks = _checked_passes(trainer, rollouts)
    trainer.train()
    assert checks["passes"] == 6 and checks["training_passes"] == 4  # 2 rounds: old-policy pass + 2 training passes
    assert any(0 in mask for r in rollouts for mask in r["tool_mask"])  # tool results inside the completions
    assert any(len(_turn_ends(mask)) >= 2 for r in rollouts for mask in r["tool_mask"])  # several turns
    print("R3 across turns, max |log-prob difference| from the copy:", checks)  # pytest -rP shows it
    # float32 noise of a padded batch vs one unpadded row over ~80 tokens; a misrouted token moves it by > 1e-3
    assert checks["first"] < 1e-4
    assert checks["last"] > 1e-3  # the rules differ: the perturbed calls route the re-fed history otherwise
    assert checks["natural"] > 1e-3
    rounds = [h for h in trainer.state.log_history if "routing/sampler_agreement" in h]
    assert rounds and all(h["routing/sampler_agreement"] < 1.0 for h in rounds)


# ---------------------------------------------------------------- a custom agent loop (rollout_func) with its routes
def test_rollout_func_routes_are_replayed_in_every_policy_pass(tmp_path, tokenizer):
    """A rollout_func that returns `routed_experts` (vLLM's layout: rows over prompt + completion minus the last
    token) gets them replayed: every policy pass equals a model copy scored with those routes forced; natural routing
    differs. The routes come from a copy of the model with perturbed routers, as a stale sampler's would."""
    from support.helpers import toy_dataset

    from trl_gspo.quickstart.model import build_model

    model = build_model(tokenizer)
    sampler = build_model(tokenizer)
    sampler.load_state_dict(model.state_dict())
    with _perturbed(sampler, 1):
        perturbed = {k: v.clone() for k, v in sampler.state_dict().items()}
    sampler.load_state_dict(perturbed)
    generator, returned = torch.Generator().manual_seed(0), {}

    def rollout(prompts, trainer):
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        completions = [torch.randint(4, 14, (int(n),), generator=generator).tolist() + [tokenizer.eos_token_id]
                       for n in torch.randint(1, 5, (len(prompts),), generator=generator)]
        routes = []
        for p, c in zip(prompt_ids, completions):
            routes.append(_natural_routes(sampler, (p + c)[:-1]).numpy().astype("uint8"))
            returned[tuple(p + c)] = torch.as_tensor(routes[-1]).long()
        return {"prompt_ids": prompt_ids, "completion_ids": completions,
                "logprobs": [[-1.0] * len(c) for c in completions], "routed_experts": routes}

    trainer = GSPOTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions],
                          args=tiny_config(tmp_path, routing_replay="sampler", routing_replay_min_agreement=0.0,
                                           steps_per_generation=2, max_steps=2, learning_rate=5e-2),
                          train_dataset=toy_dataset(), processing_class=tokenizer, rollout_func=rollout)
    checks, scoring = {"passes": 0, "forced": 0.0, "natural": 0.0}, trainer._get_per_token_logps_and_entropies

    def checked(model_, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        result = scoring(model_, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        copy_ = type(model)(model.config).eval()
        copy_.load_state_dict(model.state_dict())
        replay, width = RoutingReplay(copy_), input_ids.shape[1] - logits_to_keep
        for row in range(input_ids.shape[0]):
            mask = attention_mask[row].bool()
            prompt, completion = input_ids[row, :width][mask[:width]].tolist(), input_ids[row, width:][
                mask[width:]].tolist()
            ids, routes = torch.tensor([prompt + completion]), returned[tuple(prompt + completion)]
            with torch.no_grad():
                natural = copy_(input_ids=ids).logits
                force = torch.ones(1, len(routes), dtype=torch.bool)
                padded = torch.cat([routes, routes[-1:]])[None].to(torch.uint8)  # the last token: not forced
                with replay.replay(padded, mask=torch.cat([force, torch.zeros(1, 1, dtype=torch.bool)], 1)):
                    forced = copy_(input_ids=ids).logits
            got = result[0][row, :len(completion)].detach()
            for key, logits in (("forced", forced), ("natural", natural)):
                logits = logits[0, len(prompt) - 1:-1] / trainer.temperature
                expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
                checks[key] = max(checks[key], (expected - got).abs().max().item())
        checks["passes"] += 1
        return result

    trainer._get_per_token_logps_and_entropies = checked
    trainer.train()
    assert checks["passes"] == 3  # the old-policy pass and two training passes
    assert checks["forced"] < 1e-5 and checks["natural"] > 1e-3


def test_rollout_func_routes_of_the_wrong_shape_are_refused(tmp_path, tokenizer):
    from support.helpers import toy_dataset

    from trl_gspo.quickstart.model import build_model

    def rollout(prompts, trainer):
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        routes = [torch.zeros(len(p) + 3, 2, 2, dtype=torch.uint8).numpy() for p in prompt_ids]  # one row too many
        return {"prompt_ids": prompt_ids, "completion_ids": [[5, 6, 2]] * len(prompts),
                "logprobs": [[-1.0] * 3] * len(prompts), "routed_experts": routes}

    trainer = GSPOTrainer(build_model(tokenizer), lambda completions, **kw: [0.0] * len(completions),
                          args=tiny_config(tmp_path, routing_replay="sampler"), train_dataset=toy_dataset(),
                          processing_class=tokenizer, rollout_func=rollout)
    with pytest.raises(ValueError, match=r"routed_experts` for sample 0 has shape .*need \[\d+, layers, top_k\]"):
        trainer.train()


def test_the_tool_turn_lockstep_applies_to_the_trl_versions_read_and_measured():
    """TRL 1.16's tool loop slices a turn's results by `rank * len(prompts)` (server, TP > 1) and lets ranks leave it
    at different turns (TRL PR 6673, open): our lockstep applies to 1.16.x, the range measured in
    tests/test_tool_turns.py; a TRL release outside it runs its own loop unchanged."""
    import trl

    from trl_gspo.trainer.tool_lockstep import trl_tool_loop_needs_lockstep

    assert trl_tool_loop_needs_lockstep(trl.__version__)  # the pinned TRL (pyproject: >=1.16.0,<1.17)
    assert trl_tool_loop_needs_lockstep("1.16.0") and trl_tool_loop_needs_lockstep("1.16.3")
    assert not trl_tool_loop_needs_lockstep("1.17.0") and not trl_tool_loop_needs_lockstep("1.15.2")
