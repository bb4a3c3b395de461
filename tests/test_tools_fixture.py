"""The tiny tool-calling model (`trl_gspo.quickstart.tools`) inside TRL's own tool loop, with HF generate on CPU.

The cold-started model comes from the fixture `tool_model_dir`, built once per test run (tests/conftest.py).
"""

import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

from support.helpers import tiny_config
from trl_gspo import GSPOTrainer
from trl_gspo.quickstart.tools import (
    CalculatorEnv,
    add,
    build_tool_tokenizer,
    make_tool_rl_dataset,
    make_tool_sft_dataset,
    tool_answer_reward,
    tool_call_rate,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory's "experimental" warning
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}
EPISODE = [
    {"role": "user", "content": "add 12 34"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "add", "content": "46"},
    {"role": "assistant", "content": "46"},
]


def render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tools=[add], tokenize=True, return_dict=False, **kwargs)


@pytest.mark.parametrize("reload", [False, True])
def test_template_renders_and_parses_tool_calls(tmp_path, reload):
    tokenizer = build_tool_tokenizer()
    if reload:  # chat template and response_template survive save_pretrained / from_pretrained
        tokenizer.save_pretrained(tmp_path)
        tokenizer = AutoTokenizer.from_pretrained(tmp_path)
        assert tokenizer.response_template == build_tool_tokenizer().response_template
    text = tokenizer.apply_chat_template(EPISODE, tools=[add], tokenize=False)
    assert text == ('<bos><|system|>tools: add\n<|user|>add 12 34\n<|assistant|><tool_call>{"name":"add",'
                    '"arguments":{"a":12,"b":34}}</tool_call><eos><|tool|>46\n<|assistant|>46<eos>')
    ids = render(tokenizer, EPISODE)
    assert tokenizer.decode(ids) == text and tokenizer.unk_token_id not in ids
    assert tokenizer.padding_side == "left"
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)

    # The prompt of each turn (generation prompt included) is a prefix of the whole episode.
    prompt = render(tokenizer, EPISODE[:1], add_generation_prompt=True)
    after_tool = render(tokenizer, EPISODE[:3], add_generation_prompt=True)
    assert ids[: len(prompt)] == prompt and ids[: len(after_tool)] == after_tool
    call_turn = ids[len(prompt) : ids.index(tokenizer.eos_token_id) + 1]
    assert parse_response(tokenizer, call_turn, prefix=prompt, tools=[add]) == {
        "role": "assistant", "content": "", "tool_calls": [CALL]}
    answer = parse_response(tokenizer, ids[len(after_tool) :], prefix=after_tool, tools=[add])
    assert answer == {"role": "assistant", "content": "46"}
    # A malformed call falls back to plain text (TRL counts it as no tool call).
    broken = tokenizer.encode('<tool_call>{"name":"add","argu</tool_call><eos>', add_special_tokens=False)
    assert "tool_calls" not in parse_response(tokenizer, broken, prefix=prompt, tools=[add])


def test_datasets_rewards_and_environment():
    rl = make_tool_rl_dataset(4, seed=0)
    a, b = map(int, rl[0]["prompt"][0]["content"].split()[1:])
    assert rl[0]["prompt"][0]["role"] == "user" and rl[0]["answer"] == str(a + b)
    sft = make_tool_sft_dataset(2, seed=0)
    assert [m["role"] for m in sft[0]["completion"]] == ["assistant", "tool", "assistant"]
    good = EPISODE[1:]
    no_tool = [{"role": "assistant", "content": "46"}]
    assert tool_answer_reward([good, good[:2], no_tool, good], ["46", "46", "46", "47"]) == [1.0, 0.0, 0.0, 0.0]
    env = CalculatorEnv(limit=50)
    env.reset(prompt=rl[0]["prompt"], answer="x")
    assert env.add(a=2, b=3) == 5 and env.calls == [(2, 3)]
    with pytest.raises(ValueError):
        env.add(a=51, b=0)


def load(tool_model_dir):
    return AutoModelForCausalLM.from_pretrained(tool_model_dir), AutoTokenizer.from_pretrained(tool_model_dir)


def test_cold_started_model_calls_the_tool(tool_model_dir):
    model, tokenizer = load(tool_model_dir)
    assert tool_call_rate(model, tokenizer, num_prompts=32, seed=1) >= 0.7


class KeepRounds(GSPOTrainer):
    """GSPOTrainer that keeps what each generation round returned (for tool_mask)."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.rounds = [*getattr(self, "rounds", []), output]
        return output


def train_with_tools(tmp_path, tool_model_dir, **trainer_kwargs):
    model, tokenizer = load(tool_model_dir)
    # 8 prompts x 4 generations in one round, 2 optimizer steps on it. A first turn (call + eos) is about 45 tokens,
    # the tool suffix 5-20 and the answer 3: 96 leaves space for both turns and an error message.
    args = tiny_config(tmp_path, loss_type="gspo", per_device_train_batch_size=16, num_generations=4,
                       steps_per_generation=2, max_steps=2, max_completion_length=96, max_tool_calling_iterations=1)
    trainer = KeepRounds(model=model, reward_funcs=tool_answer_reward, args=args,
                         train_dataset=make_tool_rl_dataset(16, seed=3), processing_class=tokenizer, **trainer_kwargs)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert logs and len(trainer.rounds) == 1
    tool_mask = trainer.rounds[0]["tool_mask"]
    return trainer, logs[0], tool_mask


def test_tool_loop_with_tools(tmp_path, tool_model_dir):
    trainer, log, tool_mask = train_with_tools(tmp_path, tool_model_dir, tools=[add])
    assert log["tools/call_frequency"] > 0.5
    assert log["tools/failure_frequency"] <= 0.1  # `add` takes any ints: only a call missing an argument fails
    assert (tool_mask == 0).any(dim=1).float().mean() > 0.5  # most completions hold a tool result
    # The cold start copies operands and results often but not always: rewards vary within groups (GSPO learns).
    assert log["rewards/tool_answer_reward/mean"] > 0.1 and log["frac_reward_zero_std"] < 1.0


def test_tool_loop_with_environment_factory(tmp_path, tool_model_dir):
    # Operands run to 99; the environment refuses those over 49, so some tool calls fail.
    trainer, log, tool_mask = train_with_tools(tmp_path, tool_model_dir,
                                               environment_factory=lambda: CalculatorEnv(limit=49))
    assert log["tools/call_frequency"] > 0.5
    assert 0.0 < log["tools/failure_frequency"] < 1.0
    assert (tool_mask == 0).any(dim=1).float().mean() > 0.5
    assert sum(len(env.calls) for env in trainer.environments) > 0
