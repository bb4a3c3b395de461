"""A tiny offline model that calls a calculator tool inside TRL's own tool loop.

Everything here is built from scratch, offline, and is small enough for CPU tests:

- :func:`build_tool_tokenizer`: a character tokenizer with role markers, a chat template that renders tool calls
  (arguments with ``tojson``), tool results and ``add_generation_prompt``, and a ``response_template`` so that
  ``tokenizer.parse_response`` (which TRL calls) turns ``<tool_call>{...}</tool_call>`` back into ``tool_calls``.
- :func:`add` (for ``GRPOTrainer(tools=[add])``) and :class:`CalculatorEnv` (for ``environment_factory=``).
- :func:`make_tool_rl_dataset` and :func:`tool_answer_reward`: conversational prompts ``"add 12 34"`` and a reward
  for answering with the sum after a tool result came back.
- :func:`make_tool_sft_dataset` and :func:`build_tool_model`: full transcripts and a supervised cold start that
  teaches the tiny Qwen3-MoE to call the tool first and then repeat its result.

One rendered episode (``<eos>`` ends every assistant turn; TRL cuts the tool suffix at it)::

    <bos><|system|>tools: add
    <|user|>add 12 34
    <|assistant|><tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call><eos><|tool|>46
    <|assistant|>46<eos>
"""

from __future__ import annotations

import json
import random
import tempfile
from typing import Any

import torch
from datasets import Dataset
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from transformers.utils import get_json_schema

from .cold_start import sft_cold_start
from .model import build_model
from .tokenizer import ALPHABET, EOS_TOKEN, SPECIAL_TOKENS, UNK_TOKEN, wrap_backend

__all__ = [
    "TOOL_ALPHABET",
    "ROLE_TOKENS",
    "TOOL_CALL_TOKENS",
    "TOOL_CHAT_TEMPLATE",
    "TOOL_RESPONSE_TEMPLATE",
    "TOOL_MODEL_CONFIG",
    "MAX_OPERAND",
    "build_tool_tokenizer",
    "add",
    "CalculatorEnv",
    "make_tool_prompt",
    "make_tool_rl_dataset",
    "make_tool_sft_dataset",
    "tool_answer_reward",
    "build_tool_model",
    "tool_call_rate",
]

#: The quickstart's characters plus what JSON tool calls, tool errors and line breaks need.
TOOL_ALPHABET = ALPHABET + "{}[]()\"'_\n"
#: Role markers, one token each (special: dropped by ``decode(..., skip_special_tokens=True)``).
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
#: Tool-call delimiters, one token each (not special, so a malformed call still decodes to visible text).
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")

#: Chat template: an optional system line (system content and/or the tools' names, not their full schemas, to keep
#: prompts short), then user / assistant / tool turns. Assistant turns end with the eos token and are wrapped in
#: ``{% generation %}`` so SFT's ``assistant_only_loss`` can train on them alone. Prefix-preserving: a message renders
#: the same whatever follows it.
TOOL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if has_system or tools -%}"
    "<|system|>"
    "{%- if has_system %}{{ messages[0].content }}{% if tools %} {% endif %}{% endif -%}"
    "{%- if tools %}tools:{% for tool in tools %} {{ (tool.function or tool).name }}{% endfor %}{% endif -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}"
    "<|user|>{{ message.content }}{{ '\\n' }}"
    "{%- elif message.role == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set function = call.function or call -%}"
    "{%- set arguments = function.arguments -%}"
    "<tool_call>{\"name\":\"{{ function.name }}\",\"arguments\":"
    "{%- if arguments is string %}{{ arguments }}{% else %}{{ arguments | tojson(separators=(',', ':')) }}{% endif -%}"
    "}</tool_call>"
    "{%- endfor -%}"
    "{{ eos_token }}{% endgeneration %}"
    "{%- elif message.role == 'tool' -%}"
    "<|tool|>{{ message.content }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)

#: transformers' (>= 5.13) response template for :data:`TOOL_CHAT_TEMPLATE`: after the last ``<|assistant|>``, each
#: ``<tool_call>...</tool_call>`` is a JSON ``{"name", "arguments"}`` call and the rest up to ``<eos>`` is content.
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close": EOS_TOKEN, "content": "text"},
    },
}

#: Overrides of the quickstart MoE config: narrower (hidden 64, for a fast cold start), head_dim 32 (vLLM's CPU
#: attention refuses the default 24) and a context long enough for two assistant turns plus a tool result.
TOOL_MODEL_CONFIG = {"hidden_size": 64, "moe_intermediate_size": 64, "head_dim": 32, "max_position_embeddings": 256}

#: Operands of the calculator task are drawn from ``0..MAX_OPERAND``.
MAX_OPERAND = 99


def build_tool_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """A character tokenizer for :data:`TOOL_CHAT_TEMPLATE`, with ``chat_template`` and ``response_template`` set.

    Ids 0-3 are the quickstart's ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``; then the role markers, the tool-call
    delimiters and one token per character of :data:`TOOL_ALPHABET`. Encoding adds nothing (the chat template writes
    ``<bos>``), padding and truncation are on the left (as GRPO generation needs). ``save_pretrained`` writes the
    response template into ``tokenizer_config.json`` and the chat template into ``chat_template.jinja``; both come
    back with ``AutoTokenizer.from_pretrained``. Without ``response_template`` TRL would call ``add_response_schema``,
    which knows only TRL's shipped chat templates.
    """
    markers = ROLE_TOKENS + TOOL_CALL_TOKENS
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + markers + tuple(TOOL_ALPHABET))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # One "word" per character; `[\s\S]` because `.` does not match "\n". Added tokens are matched before this.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS + ROLE_TOKENS])
    backend.add_tokens([AddedToken(t, special=False) for t in TOOL_CALL_TOKENS])

    tokenizer = wrap_backend(backend, model_max_length)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    return tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum of a and b.
    """
    return a + b


class CalculatorEnv:
    """An environment for ``GRPOTrainer(environment_factory=CalculatorEnv)``.

    TRL builds one instance per rollout (reused across batches), calls ``reset(**row)`` with the dataset row before
    generation, and exposes every public method other than ``reset`` (and ``get_reward``, which this class leaves out:
    the reward comes from :func:`tool_answer_reward`) as a tool. Here that is :meth:`add`, which refuses operands
    outside ``0..limit`` (the exception becomes a tool failure in TRL's ``tools/failure_frequency``). ``calls`` keeps
    the arguments of every call since the last reset.
    """

    def __init__(self, limit: int = MAX_OPERAND):
        self.limit = limit
        self.calls: list[tuple[int, int]] = []

    def reset(self, **kwargs) -> None:
        """Forget earlier calls; returns None, so TRL leaves the prompt as it is."""
        self.calls = []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            The sum of a and b.
        """
        self.calls.append((a, b))
        for value in (a, b):
            if not 0 <= value <= self.limit:
                raise ValueError(f"{value} out of range")
        return a + b


def make_tool_prompt(a: int, b: int) -> str:
    """The user's request, e.g. ``"add 12 34"``."""
    return f"add {a} {b}"


def _pairs(num_examples: int, seed: int, max_operand: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(num_examples)]


def make_tool_rl_dataset(num_examples: int, seed: int = 0, max_operand: int = MAX_OPERAND) -> Dataset:
    """Conversational prompts (``[{"role": "user", "content": "add 12 34"}]``) and the ``answer`` column (``"46"``)."""
    pairs = _pairs(num_examples, seed, max_operand)
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": make_tool_prompt(a, b)}] for a, b in pairs],
        "answer": [str(a + b) for a, b in pairs],
    })


def make_tool_sft_dataset(num_examples: int, seed: int = 0, max_operand: int = MAX_OPERAND) -> Dataset:
    """Whole episodes in TRL's conversational prompt-completion format, for ``SFTTrainer``.

    ``prompt`` is the user turn; ``completion`` is the assistant's ``add`` call, the tool's result and the assistant's
    final answer (the result again); ``tools`` is the JSON schema list of :func:`add` as a JSON string (SFTTrainer
    decodes it), so the SFT prompt renders exactly like the one GRPOTrainer builds with ``tools=[add]``.
    """
    tools = json.dumps([get_json_schema(add)])
    prompts, completions = [], []
    for a, b in _pairs(num_examples, seed, max_operand):
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        prompts.append([{"role": "user", "content": make_tool_prompt(a, b)}])
        completions.append([
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)},
        ])
    return Dataset.from_dict({"prompt": prompts, "completion": completions, "tools": [tools] * num_examples})


def tool_answer_reward(completions: list[list[dict]], answer: list[str], **kwargs) -> list[float]:
    """1.0 when a tool result came back and the last message is an assistant answer equal to ``answer``, else 0.0.

    ``completions`` are TRL's conversational completions: the messages generated after the prompt, tool results
    included.
    """
    rewards = []
    for messages, expected in zip(completions, answer):
        used_tool = any(m.get("role") == "tool" for m in messages)
        last = messages[-1] if messages else {}
        final = (last.get("content") or "") if last.get("role") == "assistant" else ""
        rewards.append(float(used_tool and final.strip() == str(expected).strip()))
    return rewards


def build_tool_model(
    output_dir: str | None = None,
    sft_steps: int = 500,
    seed: int = 0,
    *,
    max_operand: int = MAX_OPERAND,
    config_overrides: dict[str, Any] | None = None,
    num_threads: int | None = 1,
    **sft_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The tiny Qwen3-MoE of the quickstart with :data:`TOOL_MODEL_CONFIG`, cold-started to call :func:`add`.

    Runs ``sft_steps`` steps of TRL's ``SFTTrainer`` (through :func:`~trl_gspo.quickstart.cold_start.sft_cold_start`,
    batch 16, learning rate 3e-3 unless ``sft_kwargs`` say otherwise) on :func:`make_tool_sft_dataset` with operands up
    to ``max_operand``, loss on the assistant turns only. ``config_overrides`` update :data:`TOOL_MODEL_CONFIG`.
    ``num_threads`` sets torch's intra-op threads for the cold start (restored after; ``None`` leaves them): this
    model is so small that one thread beats two, by far on a busy machine. With ``output_dir`` the model and
    tokenizer are saved there (a directory vLLM can load). Returns ``(model, tokenizer)``, the model in eval mode.

    What the defaults' cold start costs: docs/results.md#the-tool-calling-quickstart.
    """
    tokenizer = build_tool_tokenizer()
    model = build_model(tokenizer, config_overrides={**TOOL_MODEL_CONFIG, **(config_overrides or {})}, seed=seed)
    batch_size = sft_kwargs.pop("per_device_train_batch_size", 16)
    dataset = make_tool_sft_dataset(max(sft_steps * batch_size, 1), seed=seed + 10_000, max_operand=max_operand)
    sft_kwargs.setdefault("assistant_only_loss", True)
    sft_kwargs.setdefault("max_length", tokenizer.model_max_length)
    threads = torch.get_num_threads()
    if sft_steps > 0:
        try:
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            with tempfile.TemporaryDirectory() as scratch:
                model = sft_cold_start(model, tokenizer, scratch, max_steps=sft_steps, seed=seed, dataset=dataset,
                                       per_device_train_batch_size=batch_size, **sft_kwargs)
        finally:
            torch.set_num_threads(threads)
    model.eval()
    if output_dir is not None:
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    return model, tokenizer


@torch.no_grad()
def tool_call_rate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    num_prompts: int = 32,
    seed: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
) -> float:
    """Share of sampled first turns that parse to a well-formed ``add`` call with integer ``a`` and ``b``.

    Samples one completion per prompt of :func:`make_tool_rl_dataset` with ``model.generate`` and parses it as TRL
    does (``tokenizer.parse_response`` with the prompt as prefix).
    """
    prompts = list(make_tool_rl_dataset(num_prompts, seed=seed)["prompt"])
    batch = tokenizer.apply_chat_template(prompts, tools=[add], add_generation_prompt=True, padding=True,
                                          return_dict=True, return_tensors="pt")
    torch.manual_seed(seed)
    out = model.generate(**batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    good = 0
    width = batch["input_ids"].shape[1]
    for row, mask in zip(out, batch["attention_mask"]):
        prompt = row[:width][mask.bool()].tolist()
        ids = row[width:].tolist()
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
        try:
            parsed = tokenizer.parse_response(ids, prefix=prompt, tools=[add])
        except (ValueError, TypeError):
            continue
        calls = parsed.get("tool_calls") or []
        args = calls[0].get("function", {}).get("arguments", {}) if len(calls) == 1 else {}
        good += bool(calls) and calls[0]["function"].get("name") == "add" and isinstance(args, dict) and (
            set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values()))
    return good / num_prompts
