"""Rollout routing replay (R3) from HF generate: routes and sampler log-probs recorded during `generate`, laid out
like TRL's padded `[prompt | completion]` tensors, checked against one full forward over the same tokens.

On CPU, generate with a KV cache and one full forward in the same dtype give the same routes and log-probs (float32
difference ~1e-7, measured with these tests), so a full forward is an independent reference for the recorded
alignment."""

import contextlib

import pytest
import torch

from trl_gspo.quickstart.model import build_model
from trl_gspo.routing import (RoutingReplay, RoutingReplayError, has_route, no_route, pad_routes_like,
                              record_generation, route_changes, route_dtype)

EOS = [2, 10, 11, 12, 13, 14]  # several stop tokens so completions end at different steps
PROMPT_LENGTHS = [5, 9, 3, 7]
MAX_NEW = 10
EXTRA_LEFT, EXTRA_RIGHT = 2, 3  # TRL re-pads (pad_to_multiple_of): the layout differs from generate's


def _model(tokenizer, dtype=torch.float32, router_logit_std=1.0, **overrides):
    config = {"num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3, **overrides}
    return build_model(tokenizer, config, router_logit_std=router_logit_std).to(dtype).eval()


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, length in enumerate(PROMPT_LENGTHS):
        ids[i, width - length:] = torch.randint(15, 50, (length,), generator=g)
        mask[i, width - length:] = 1
    return ids, mask


def _completion_lengths(sequences, width):
    """TRL's rule: keep up to and including the first stop token."""
    completions = sequences[:, width:]
    is_eos = torch.isin(completions, torch.tensor(EOS))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.shape[1] - 1)
    return (first + 1).tolist()


def _generate(model, temperature, seed=1, max_new_tokens=MAX_NEW):
    ids, mask = _prompts()
    rr = RoutingReplay(model)
    torch.manual_seed(seed)
    with torch.no_grad(), record_generation(rr, temperature=temperature) as rec:
        sequences = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                   top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=EOS,
                                   pad_token_id=0, use_cache=True)
    lengths = _completion_lengths(sequences, ids.shape[1])
    return ids, mask, sequences, lengths, rec.per_sample(sequences, mask, lengths)


def _trl_batch(sequences, width, lengths):
    """TRL's padded tensors: prompts left-padded, completions right-padded, both wider than generate's."""
    prompts = [row[:width][mask.bool()] for row, mask in zip(sequences, _prompts()[1])]
    completions = [row[width:width + n] for row, n in zip(sequences, lengths)]
    p_width, c_width = max(map(len, prompts)) + EXTRA_LEFT, max(lengths) + EXTRA_RIGHT
    batch = len(prompts)
    prompt_ids = torch.zeros(batch, p_width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.zeros(batch, c_width, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[i, p_width - len(p):], prompt_mask[i, p_width - len(p):] = p, 1
        completion_ids[i, :len(c)], completion_mask[i, :len(c)] = c, 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _scored_logps(model, ids, attention_mask, p_width, completion_ids, temperature, routes=None):
    """Per-token log-probs of the completion under one full forward (optionally replaying `routes`), and the
    forward's routes as the experts saw them."""
    rr, probe = RoutingReplay(model), RoutingReplay(model)
    with torch.no_grad(), contextlib_replay(rr, routes, attention_mask):
        with probe.record() as seen:  # hooks after replay's: sees the forced experts
            logits = model(input_ids=ids, attention_mask=attention_mask).logits
    logits = logits[:, p_width - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1), seen.indices


def contextlib_replay(rr, routes, attention_mask):
    import contextlib

    if routes is None:
        return contextlib.nullcontext()
    keep = has_route(routes) & attention_mask.bool()
    return rr.replay(routes, mask=keep, stats_mask=keep)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_routes_align_with_one_full_forward(tokenizer, temperature):
    model = _model(tokenizer)
    ids, mask, sequences, lengths, sampled = _generate(model, temperature)
    width = ids.shape[1]
    generated = sequences.shape[1] - width
    # the test covers what it claims: ragged prompts, completions ending at different steps, one cut at max_new_tokens
    assert len(set(lengths)) >= 3 and min(lengths) < generated and max(lengths) == MAX_NEW == generated
    assert [len(r) for r in sampled.prompt_routes] == PROMPT_LENGTHS
    assert [len(r) for r in sampled.completion_routes] == [len(lp) for lp in sampled.sampler_logps] == lengths

    prompt_ids, prompt_mask, completion_ids, completion_mask = _trl_batch(sequences, width, lengths)
    p_width = prompt_ids.shape[1]
    full_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    routes = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, prompt_mask, completion_mask)
    assert routes.shape == (*full_ids.shape, 3, 2) and routes.dtype == torch.uint8
    sampler = torch.zeros(completion_ids.shape, dtype=torch.float64)
    for i, lp in enumerate(sampled.sampler_logps):
        sampler[i, :len(lp)] = lp.double()
    scored = completion_mask.bool()
    real = has_route(routes) & attention.bool()

    def aligned(candidate):
        """Replaying `candidate` reproduces the sampler's log-probs, and the forward's natural routes equal it."""
        replayed, _ = _scored_logps(model, full_ids, attention, p_width, completion_ids, temperature, candidate)
        _, natural = _scored_logps(model, full_ids, attention, p_width, completion_ids, temperature)
        logps_match = torch.allclose(replayed[scored], sampler[scored], rtol=0, atol=1e-5)
        routes_match = not route_changes(natural, candidate)[real].any()
        return logps_match, routes_match

    assert aligned(routes) == (True, True)

    # The same routes one token late (each completion token gets its predecessor's routes): the check must fail.
    shifted_completion = [torch.cat([p[-1:], c[:-2], c[-1:]]) if len(c) > 1 else c
                          for p, c in zip(sampled.prompt_routes, sampled.completion_routes)]
    shifted = pad_routes_like(sampled.prompt_routes, shifted_completion, prompt_mask, completion_mask)
    assert aligned(shifted) == (False, False)


def test_sampler_logps_are_tempered_log_softmax_of_a_full_forward(tokenizer):
    temperature = 0.6
    model = _model(tokenizer)
    ids, mask, sequences, lengths, sampled = _generate(model, temperature, seed=3)
    width = ids.shape[1]
    prompt_ids, prompt_mask, completion_ids, completion_mask = _trl_batch(sequences, width, lengths)
    full_ids = torch.cat([prompt_ids, completion_ids], 1)
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
    logits = logits[:, prompt_ids.shape[1] - 1:-1].double()
    for i, n in enumerate(lengths):  # float64 reference: log softmax(z / T)_y = z_y / T - logsumexp(z / T)
        z, y = logits[i, :n] / temperature, completion_ids[i, :n]
        reference = z.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
        untempered = torch.log_softmax(logits[i, :n], -1).gather(-1, y[:, None]).squeeze(-1)
        assert sampled.sampler_logps[i].dtype == torch.float32
        torch.testing.assert_close(sampled.sampler_logps[i].double(), reference, rtol=0, atol=1e-5)
        assert not torch.allclose(untempered, reference, atol=1e-3)  # the temperature is really applied


def test_last_completion_token_and_padding_have_no_route(tokenizer):
    model = _model(tokenizer)
    ids, mask, sequences, lengths, sampled = _generate(model, 1.0)
    prompt_ids, prompt_mask, completion_ids, completion_mask = _trl_batch(sequences, ids.shape[1], lengths)
    routes = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, prompt_mask, completion_mask)
    p_width = prompt_ids.shape[1]
    expected = torch.cat([prompt_mask, completion_mask], 1).bool()
    for i, n in enumerate(lengths):
        expected[i, p_width + n - 1] = False  # the last sampled token was never fed forward
        assert (sampled.completion_routes[i][-1] == 255).all()
    assert torch.equal(has_route(routes), expected)
    assert (routes[~expected] == no_route(torch.uint8)).all()
    assert routes.device.type == "cpu" and routes.element_size() == 1  # 1 byte per (token, layer, k), off device
    assert ((routes[expected] < 8).all(-1)).all()  # every real slot is a real expert of the 8
    # expert 0 is a real, used route (so 0 as a sentinel would have been ambiguous)
    assert (routes[expected] == 0).any()


def test_route_dtype_and_sentinel_rules(tokenizer):
    assert route_dtype(8, 2) == route_dtype(255, 1) == route_dtype(256, 2) == torch.uint8
    assert route_dtype(256, 1) == route_dtype(300, 2) == torch.int16  # 255 is a real top-1 route with 256 experts
    assert route_dtype(40000, 1) == torch.int32
    assert no_route(torch.uint8) == 255 and no_route(torch.int16) == 32767
    routes = torch.tensor([[[[255]], [[no_route(torch.int16)]], [[0]]]], dtype=torch.int16)  # [1, 3, 1, 1]
    assert has_route(routes).tolist() == [[True, False, True]]
    top2 = torch.tensor([[[[3, 255]], [[255, 255]], [[0, 1]]]], dtype=torch.uint8)  # 256 experts top-2
    assert has_route(top2).tolist() == [[True, False, True]]
    one_layer_missing = torch.tensor([[[[1, 2], [255, 255]]]], dtype=torch.uint8)  # [1, 1, 2 layers, 2]
    assert has_route(one_layer_missing).tolist() == [[False]]

    model = _model(tokenizer, num_experts=256, num_experts_per_tok=1, num_hidden_layers=2, moe_intermediate_size=4)
    ids, _, sequences, lengths, sampled = _generate(model, 1.0, max_new_tokens=4)
    assert all(r.dtype == torch.int16 for r in sampled.prompt_routes + sampled.completion_routes)
    assert all((r.long() < 256).all() for r in sampled.prompt_routes)
    assert all((c[-1] == 32767).all() and has_route(c[None])[0].tolist() == [True] * (len(c) - 1) + [False]
               for c in sampled.completion_routes)
    # the int16 sentinel passes through replay untouched when masked out, and the real routes are the forward's own
    prompt_ids, prompt_mask, completion_ids, completion_mask = _trl_batch(sequences, ids.shape[1], lengths)
    routes = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, prompt_mask, completion_mask)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    full_ids = torch.cat([prompt_ids, completion_ids], 1)
    _, forced = _scored_logps(model, full_ids, attention, prompt_ids.shape[1], completion_ids, 1.0, routes)
    real = has_route(routes) & attention.bool()
    assert real.sum() > 0 and not route_changes(forced, routes)[real].any()


def test_pad_routes_like_refuses_misaligned_lengths_and_padding():
    routes = [torch.zeros(3, 2, 2, dtype=torch.uint8), torch.ones(2, 2, 2, dtype=torch.uint8)]
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    out = pad_routes_like(routes, routes, prompt_mask, completion_mask)
    assert out.shape == (2, 8, 2, 2)
    assert torch.equal(has_route(out), torch.cat([prompt_mask, completion_mask], 1).bool())
    with pytest.raises(RoutingReplayError, match="length mismatch in row 1"):
        pad_routes_like(routes, routes, prompt_mask, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]]))
    with pytest.raises(RoutingReplayError, match="prompt_mask row 0 is not left-padded"):
        pad_routes_like(routes, routes, torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]]), completion_mask)
    with pytest.raises(RoutingReplayError, match="completion_mask row 1 is not right-padded"):
        pad_routes_like(routes, routes, prompt_mask, torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]]))
    with pytest.raises(RoutingReplayError, match="same samples"):
        pad_routes_like(routes[:1], routes, prompt_mask, completion_mask)


def _record(model, extra_forward=False, **generate_kwargs):
    ids, mask = _prompts()
    rr = RoutingReplay(model)
    torch.manual_seed(1)
    with torch.no_grad(), record_generation(rr, temperature=0.7) as rec:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                             max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=0, use_cache=True,
                             return_dict_in_generate=True, **generate_kwargs)
        if extra_forward:  # what transformers' DeferredStopCheck does (on mps): one more step, then undone
            grown = torch.cat([mask, torch.ones(len(ids), out.sequences.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
            model(input_ids=out.sequences[:, -1:], attention_mask=grown, past_key_values=out.past_key_values)
    return rec, rec.per_sample(out.sequences, mask, _completion_lengths(out.sequences, ids.shape[1]))


@contextlib.contextmanager
def _a_peer_generating_for(steps, monkeypatch):
    """transformers' `synced_gpus` loop on one process, as on a ZeRO-3 rank whose peer is still generating: the
    all-reduce of "unfinished" flags reports that peer for `steps` more steps after this rank has finished."""
    import transformers.generation.utils as generation_utils

    left = [steps]

    def all_reduce(flag, op=None):
        if flag.item() == 0.0 and left[0] > 0:
            left[0] -= 1
            flag += 1.0
    monkeypatch.setattr(generation_utils.dist, "all_reduce", all_reduce)
    yield left


@pytest.mark.parametrize("variant", ["chunked_prefill", "extra_forward", "synced_gpus"])
def test_chunked_prefill_and_an_extra_decode_forward_give_the_same_recording(tokenizer, variant, monkeypatch):
    """Also ZeRO-3's `synced_gpus`: a rank that finished keeps calling the model (fed its last token) while a peer
    generates; those forwards are not this rank's tokens and are dropped (the ZeRO-3 + R3 tool-turn failure)."""
    model = _model(tokenizer)
    plain_rec, plain = _record(model)
    if variant == "synced_gpus":
        with _a_peer_generating_for(3, monkeypatch) as left:
            rec, other = _record(model, synced_gpus=True)
        assert left == [0]
    else:
        rec, other = _record(model, **({"prefill_chunk_size": 4} if variant == "chunked_prefill" else
                                       {"extra_forward": True}))
    extra = {"chunked_prefill": 2, "extra_forward": 1, "synced_gpus": 3}[variant]
    assert len(rec.fed) == len(plain_rec.fed) + extra  # the variant happened
    for a, b in zip(plain.prompt_routes + plain.completion_routes, other.prompt_routes + other.completion_routes):
        assert torch.equal(a, b)
    for a, b in zip(plain.sampler_logps, other.sampler_logps):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_recording_refuses_generate_without_kv_cache(tokenizer):
    model = _model(tokenizer)
    ids, mask = _prompts()
    rr = RoutingReplay(model)
    with torch.no_grad(), record_generation(rr) as rec:
        sequences = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=3,
                                   eos_token_id=EOS, pad_token_id=0, use_cache=False)
    with pytest.raises(RoutingReplayError, match="do not line up"):
        rec.per_sample(sequences, mask, [3] * len(ids))
    with torch.no_grad(), record_generation(rr) as rec:  # two generate calls in one block
        for _ in range(2):
            sequences = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=3,
                                       eos_token_id=EOS, pad_token_id=0, use_cache=True)
    with pytest.raises(RoutingReplayError, match="do not line up"):
        rec.per_sample(sequences, mask, [1] * len(ids))


def test_bf16_sampler_routes_are_forced_in_an_fp32_forward(tokenizer):
    """The mixed-precision gap of a bf16 sampler and an fp32 trainer: without replay some (token, layer) route sets
    differ; replaying the sampler's routes makes the fp32 forward use exactly the sampler's experts."""
    # 32 experts top-4 (a small proxy of a real MoE) with narrower routers than the other tests: closer races between
    # experts
    shape = dict(num_experts=32, num_experts_per_tok=4, num_hidden_layers=4, router_logit_std=0.3)
    fp32, bf16 = _model(tokenizer, **shape), _model(tokenizer, dtype=torch.bfloat16, **shape)
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})  # same (bf16-representable) weights
    ids, mask, sequences, lengths, sampled = _generate(bf16, 1.0, max_new_tokens=MAX_NEW)
    prompt_ids, prompt_mask, completion_ids, completion_mask = _trl_batch(sequences, ids.shape[1], lengths)
    full_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    routes = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, prompt_mask, completion_mask)
    real = has_route(routes) & attention.bool()
    p_width = prompt_ids.shape[1]
    _, natural = _scored_logps(fp32, full_ids, attention, p_width, completion_ids, 1.0)
    _, forced = _scored_logps(fp32, full_ids, attention, p_width, completion_ids, 1.0, routes)
    differed = route_changes(natural, routes, per_layer=True)[real]
    print(f"bf16 sampler vs fp32 forward: {int(differed.sum())} of {differed.numel()} (token, layer) route sets "
          f"differ without replay")
    assert differed.any()  # the precision gap is real here, so replay has something to force
    assert not route_changes(forced, routes, per_layer=True)[real].any()


def test_peft_wrapped_model_records_the_inner_generation_forwards(tokenizer):
    """PEFT's generate calls the inner transformers model, bypassing the wrapper's forward: the recorder hooks the
    module generate really calls. Fresh LoRA adapters (B = 0) leave the model unchanged, so the routes must match."""
    from peft import LoraConfig, get_peft_model

    model = _model(tokenizer)
    _, plain = _record(model)
    _, wrapped = _record(get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])))
    for a, b in zip(plain.prompt_routes + plain.completion_routes, wrapped.prompt_routes + wrapped.completion_routes):
        assert torch.equal(a, b)


def test_per_sample_refuses_impossible_completion_lengths(tokenizer):
    ids, mask = _prompts()
    rec, _ = _record(_model(tokenizer))
    generated = len(rec.fed)  # one prefill, then one decode call per new token but the last
    sequences = torch.cat([ids, torch.zeros(len(mask), generated, dtype=torch.long)], 1)
    with pytest.raises(RoutingReplayError, match="completion lengths"):
        rec.per_sample(sequences, mask, [generated + 1] * len(mask))
