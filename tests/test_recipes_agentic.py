"""The agentic Qwen3-30B-A3B recipes (recipes/qwen3_30b_a3b/agentic/): the calculator tool in TRL's tool loop with R3,
in the flagship's two multi-process vLLM layouts (server with 4 training processes, colocate at tensor parallel 2).

Each recipe differs from its non-tool sibling in ../vllm_server/ or ../vllm_colocate/ only in the tool keys, model,
reward, completion budget, loss and replay; it dry-runs from the repository root without loading a model (also via
tests/test_cli.py's glob of recipes/); the header's commands parse; the calculator, its JSON schema and the reward
work with TRL 1.16's Qwen3 chat template and parser (TRL's stored copy: the hub model is not downloaded here)."""

import shlex
from pathlib import Path

import pytest
import yaml
from support.recipe_headers import command_gpus, header_commands

from trl_gspo.launch.cli import main, parse_recipe

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "recipes" / "qwen3_30b_a3b" / "agentic"
LAYOUTS = {"gspo_tools_vllm_server": "vllm_server", "gspo_tools_vllm_colocate": "vllm_colocate"}
# What an agentic recipe may change from the same layout's gspo.yaml without tools.
AGENTIC_KEYS = {"model_name_or_path", "reward_funcs", "tools", "max_tool_calling_iterations", "chat_template_kwargs",
                "max_completion_length", "loss_type", "failed_tool_credit", "routing_replay", "routing_replay_offload",
                "output_dir"}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture
def from_root(monkeypatch):
    """The recipes name their tool and reward by dotted paths from the repository root (their headers say so)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))


@pytest.fixture
def qwen3_tokenizer():
    """A tokenizer with TRL 1.16's stored Qwen3 chat template (what `add_response_schema` matches exactly); the
    character vocabulary does not matter to rendering and parsing text."""
    from trl.chat_template_utils import qwen3_chat_template

    from trl_gspo.quickstart.tools import build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    tokenizer.chat_template, tokenizer.response_template = qwen3_chat_template, None
    return tokenizer


def test_every_agentic_recipe_is_listed_here():
    assert sorted(p.stem for p in FOLDER.glob("*.yaml")) == sorted(LAYOUTS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_differs_from_its_non_tool_sibling_only_in_tools_model_reward_budget_loss_and_replay(name):
    sibling, recipe = _load(ROOT / "recipes" / "qwen3_30b_a3b" / LAYOUTS[name] / "gspo.yaml"), _load(FOLDER /
                                                                                                   f"{name}.yaml")
    changed = {key for key in set(sibling) | set(recipe) if sibling.get(key) != recipe.get(key)}
    assert changed <= AGENTIC_KEYS, changed - AGENTIC_KEYS
    assert recipe["model_name_or_path"] == "Qwen/Qwen3-30B-A3B"  # post-trained: the -Base model has no tool format
    assert recipe["tools"] == ["recipes.qwen3_30b_a3b.agentic.tools.calculate"]
    assert recipe["reward_funcs"] == ["recipes.qwen3_30b_a3b.agentic.rewards.final_answer_accuracy"]
    assert recipe["routing_replay"] == "sampler" and recipe["use_vllm"] is True
    assert (recipe["loss_type"], recipe["epsilon"], recipe["epsilon_high"]) == ("gspo_token", 3e-4, 4e-4)
    assert recipe["failed_tool_credit"] < 0 and recipe["chat_template_kwargs"] == {"enable_thinking": False}
    # The layouts GSPOTrainer used to refuse for R3 with tools (TRL PR 6673): several processes share one sampler call.
    if recipe["vllm_mode"] == "server":
        assert recipe["num_processes"] > 1
    else:
        assert recipe["vllm_tensor_parallel_size"] == 2 and recipe["num_processes"] % 2 == 0
    # The budget holds every turn and tool result (TRL drops a tool result that does not fit): more than one
    # single-turn answer of the sibling's length.
    assert recipe["max_completion_length"] >= 2 * sibling["max_completion_length"]


@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "gpu"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_dry_run_from_the_repository_root(name, gpu, from_root, capsys, monkeypatch, fake_accelerator):
    """Resolves without loading a model: the tool and the reward import by their dotted paths; the hub dataset is only
    recorded (offline here) and vLLM's version check answers as for an installed vLLM, as in tests/test_cli.py."""
    from trl_gspo.sampling import engine

    fake_accelerator(gpu)
    monkeypatch.setattr(engine, "installed_vllm_version", lambda: engine.VLLM_RANGE[0])
    probed = []
    monkeypatch.setattr("trl_gspo.launch.checks._probe_dataset", lambda key, path, config: probed.append(path))
    monkeypatch.setattr("trl_gspo.launch.checks._probe_model", lambda key, name: None)  # hub model, offline
    assert main(["--config", str(FOLDER / f"{name}.yaml"), "--dry_run", "true"]) == 0
    out = capsys.readouterr().out
    assert "recipe is valid" in out and probed == ["trl-lib/DeepMath-103K"]
    if not gpu:
        return  # parse_recipe validates bf16 as written, which needs the (faked) GPU
    script, training, *_ = parse_recipe(["--config", str(FOLDER / f"{name}.yaml")])
    assert training.chat_template_kwargs == {"enable_thinking": False}  # reaches TRL's apply_chat_template as a dict
    assert training.loss_type == "gspo_token" and training.routing_replay == "sampler"
    assert script.tools and script.failed_tool_credit == -0.5


def test_server_launch_commands():
    """Server on GPUs 4-7 sized by its parallelism (parsed with `trl vllm-serve`'s own parser, the arguments
    `trl-gspo vllm-serve` takes), trainer on the other four, and its `accelerate launch` spelling."""
    from trl.scripts.vllm_serve import make_parser

    path = FOLDER / "gspo_tools_vllm_server.yaml"
    recipe = _load(path)
    check, server, trainer, accelerate = header_commands(path)
    assert check.startswith("python -c ")
    server_gpus, trainer_gpus = command_gpus(server), command_gpus(trainer)
    assert not set(server_gpus) & set(trainer_gpus) and len(trainer_gpus) == recipe["num_processes"]
    assert server.split()[1:3] == ["trl-gspo", "vllm-serve"]
    (args,) = make_parser().parse_args_and_config(args=shlex.split(server)[3:])
    assert args.model == recipe["model_name_or_path"] and args.port == recipe["vllm_server_port"]
    assert len(server_gpus) == args.tensor_parallel_size * args.data_parallel_size
    config = f"recipes/qwen3_30b_a3b/agentic/{path.name}"
    assert trainer.split()[1:] == ["trl-gspo", "--config", config]
    words = accelerate.split()
    assert command_gpus(accelerate) == trainer_gpus and words[1:3] == ["accelerate", "launch"]
    assert words[words.index("--config_file") + 1] == "recipes/accelerate/zero3_offload.yaml"
    assert words[words.index("--num_processes") + 1] == str(recipe["num_processes"])
    assert words[-4:] == ["-m", "trl_gspo.launch.train", "--config", config]
    assert (path.parent / recipe["accelerate_config"]).resolve() == ROOT / "recipes/accelerate/zero3_offload.yaml"


def test_colocate_launch_commands():
    path = FOLDER / "gspo_tools_vllm_colocate.yaml"
    recipe = _load(path)
    check, trainer, accelerate = header_commands(path)
    assert check.startswith("python -c ")
    config = f"recipes/qwen3_30b_a3b/agentic/{path.name}"
    assert trainer == f"trl-gspo --config {config}"
    assert accelerate == (f"accelerate launch --config_file recipes/accelerate/zero3_offload.yaml --num_processes "
                          f"{recipe['num_processes']} -m trl_gspo.launch.train --config {config}")


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_headers_template_check_passes_for_trls_qwen3_template(name, qwen3_tokenizer, monkeypatch, capsys):
    """The header's pre-download check, run with `from_pretrained` answering TRL's stored Qwen3 template for the
    recipe's model: TRL 1.16 recognizes it for parsing tool calls and has a prefix-preserving training variant."""
    import transformers
    from trl.chat_template_utils import qwen3_template, qwen3_training_chat_template

    path = FOLDER / f"{name}.yaml"
    command = header_commands(path)[0]
    words = shlex.split(command)
    assert words[:2] == ["python", "-c"]
    asked = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda model, *a, **k: asked.append(model) or qwen3_tokenizer)
    exec(words[2], {})
    assert asked == [_load(path)["model_name_or_path"]] and "parses its tool calls" in capsys.readouterr().out
    assert qwen3_tokenizer.response_template == qwen3_template
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    # Qwen3's own template is not prefix-preserving, so TRL's tool loop swaps in the training variant.
    assert not is_chat_template_prefix_preserving(qwen3_tokenizer)
    assert get_training_chat_template(qwen3_tokenizer) == qwen3_training_chat_template


def test_calculate_through_qwen3s_template_and_parser(from_root, qwen3_tokenizer):
    """The schema TRL renders into Qwen3's system prompt, a Qwen3-format call parsed by TRL's parser, and the call."""
    from transformers.utils import get_json_schema
    from trl.chat_template_utils import add_response_schema

    from recipes.qwen3_30b_a3b.agentic.tools import calculate

    schema = get_json_schema(calculate)["function"]  # TRL's requirement: type hints and an `Args:` entry
    assert schema["name"] == "calculate" and schema["parameters"]["required"] == ["expression"]
    add_response_schema(qwen3_tokenizer)
    prefix = qwen3_tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 * 1024?"}], tools=[calculate],
                                                 tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert '"name": "calculate"' in prefix and prefix.endswith("<think>\n\n</think>\n\n")
    reply = ('I will compute it.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "(3 + 4) * 2**10"}}'
             "\n</tool_call><|im_end|>")
    (call,) = qwen3_tokenizer.parse_response(reply, prefix=prefix, tools=[calculate])["tool_calls"]
    assert call["function"]["name"] == "calculate"
    assert calculate(**call["function"]["arguments"]) == "7168"


@pytest.mark.parametrize("expression,value", [("(3 + 4) * 2**10", "7168"), ("0.1 + 0.2", "0.3"), ("7 / 2", "3.5"),
                                              ("7 // 2", "3"), ("-7 % 3", "2"), ("2^10", "1024"), ("1e-5 * 3", "3e-05"),
                                              ("10**99", "1" + "0" * 99)])
def test_calculate_values(from_root, expression, value):
    from recipes.qwen3_30b_a3b.agentic.tools import calculate

    assert calculate(expression) == value


@pytest.mark.parametrize("expression,needle", [
    ("__import__('os').system('true')", "unsupported"), ("x + 1", "unsupported"), ("abs(-3)", "unsupported"),
    ("True + 1", "unsupported"), ("2 * (3", "not a valid"), ("", "not a valid"), ("1 / 0", "division by zero"),
    ("3 % 0", "division by zero"), ("9**9**9", "too large"), ("2.0**10000", "too large"), ("1e308 * 10", "not finite"),
    ("(-2)**0.5", "not a real number"), ("10**100", "more than 100"), ("1+" * 300 + "1", "longer than 500")])
def test_calculate_refusals_are_short_errors(from_root, expression, needle):
    """Every refusal is a ValueError (TRL turns it into the tool result {'error': '...'}, a failed call) short enough
    that the result fits the completion budget: at most ~130 characters, as the headers say."""
    from recipes.qwen3_30b_a3b.agentic.tools import calculate

    with pytest.raises(ValueError, match=needle) as err:
        calculate(expression)
    assert len(str({"error": str(err.value)})) <= 130


def test_final_answer_accuracy_reads_the_last_turn(from_root):
    """TRL's accuracy_reward scores `completion[0]`, which in a tool episode is the turn before the call: 0 for a right
    final answer. The recipes' reward passes it the last assistant turn."""
    from trl.rewards import accuracy_reward

    from recipes.qwen3_30b_a3b.agentic.rewards import final_answer_accuracy

    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2*3"}}}
    episode = [{"role": "assistant", "content": "Let me compute.", "tool_calls": [call]},
               {"role": "tool", "name": "calculate", "content": "6"},
               {"role": "assistant", "content": r"The answer is $\boxed{6}$."}]
    single = [{"role": "assistant", "content": r"The answer is $\boxed{6}$."}]
    wrong = [{"role": "assistant", "content": r"The answer is $\boxed{7}$."}]
    unanswered = episode[:2]  # the loop ended after a tool result (iterations used up)
    assert final_answer_accuracy([episode, single, wrong, unanswered], ["6"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert accuracy_reward([episode], ["6"]) == [0.0]
