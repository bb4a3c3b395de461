"""Every recipe mistake that can be checked offline is refused before launch: `trl-gspo ...
--dry_run true` exits 2 with one line that names the key and the fix, and no model is built or loaded. Each test
is a dry run in this process (a fraction of a second each)."""

import json
import re
import textwrap

import pytest
from support.helpers import BASE_RECIPE as BASE

import trl_gspo.launch.launching
import trl_gspo.quickstart.model
from trl_gspo import GSPOConfig
from trl_gspo.launch.cli import main


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything builds or loads a model, or launches training."""
    import transformers

    def loaded(*args, **kwargs):
        pytest.fail("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    monkeypatch.setattr(trl_gspo.quickstart.model, "build_model", loaded)
    monkeypatch.setattr(trl_gspo.quickstart.model, "build_dense_model", loaded)
    monkeypatch.setattr(trl_gspo.launch.launching, "run_forwarding_signals", loaded)


def _recipe(tmp_path, body=BASE, replace=(), extra=""):
    text = textwrap.dedent(body).format(out=tmp_path / "out")
    for old, new in replace:
        text = text.replace(old, new)
    path = tmp_path / "recipe.yaml"
    path.write_text(text + extra)
    return str(path)


def _refused(capsys, argv, *needles):
    """`trl-gspo argv --dry_run true` exits 2 with one `trl-gspo: error:` line that names each needle and a fix."""
    assert main([*argv, "--dry_run", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trl-gspo: error: ") and "\n" not in err, err
    assert "Fix:" in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_a_key_left_empty(tmp_path, capsys, no_model):
    recipe = _recipe(tmp_path, extra="learning_rate:\n")  # YAML: null
    _refused(capsys, [recipe], "`learning_rate` is empty", "delete the line")


def test_a_key_left_empty_that_may_be_none_is_accepted(tmp_path, capsys, no_model):
    assert main([_recipe(tmp_path, extra="epsilon:\n"), "--dry_run", "true"]) == 0  # None: the GSPO paper's value
    assert "epsilon=0.0003" in capsys.readouterr().out


@pytest.mark.parametrize("output_dir,needle", [("/proc/trl-gspo-run", "cannot create '/proc/trl-gspo-run'"),
                                               ("{file}/run", "is a file")])
def test_an_output_dir_that_cannot_be_created(tmp_path, capsys, no_model, output_dir, needle):
    (tmp_path / "file").write_text("")
    output_dir = output_dir.format(file=tmp_path / "file")
    _refused(capsys, [_recipe(tmp_path), "--output_dir", output_dir], "`output_dir`", needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "recipe.yaml"]  # the probe left nothing behind


def test_the_output_dir_is_not_created_by_a_dry_run(tmp_path, capsys, no_model):
    assert main([_recipe(tmp_path), "--output_dir", str(tmp_path / "a" / "b"), "--dry_run", "true"]) == 0
    assert not (tmp_path / "a").exists()


def _refused_at_launch_listed_by_a_dry_run(capsys, recipe, key, name):
    """Without the Hub (the test environment is offline), a run is refused before launch; a dry run passes and lists
    what it could not check (tests/test_dry_run_offline.py runs every shipped recipe so)."""
    assert main([recipe]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"trl-gspo: error: `{key}`: '{name}' is neither a local path") and "Fix:" in err, err
    assert main([recipe, "--dry_run", "true"]) == 0
    block = capsys.readouterr().out.split("not checked on this machine (the Hub: offline mode is on")[1]
    assert re.search(rf"\n  {key} +{name}: that it exists", block), block


def test_a_dataset_that_is_neither_local_nor_reachable(tmp_path, capsys, no_model):
    recipe = _recipe(tmp_path, replace=[("builtin:addition", "trl-gspo-tests/no-such-dataset")])
    _refused_at_launch_listed_by_a_dry_run(capsys, recipe, "dataset_name", "trl-gspo-tests/no-such-dataset")


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


# Runs `trl-gspo` (`python -m trl_gspo.launch.cli`, argv after the two paths) and writes to the first path what the
# run did that costs time without showing it: its connection attempts to a host:port (the second path's argument is
# that port) and the seconds it asked `time.sleep` for (every retry loop's backoff).
_COUNTING_CLI = """
import atexit, json, runpy, sys, time

record, port = sys.argv[1], int(sys.argv[2])
connects, slept = [], []

def hook(event, args):
    if event == "socket.connect" and isinstance(args[1], tuple) and len(args[1]) >= 2 and args[1][1] == port:
        connects.append(str(args[1]))

sys.addaudithook(hook)
_sleep = time.sleep

def counting_sleep(seconds):
    slept.append(seconds)
    _sleep(seconds)

time.sleep = counting_sleep
atexit.register(lambda: open(record, "w").write(json.dumps({"connects": connects, "slept": sum(slept)})))
sys.argv = ["trl-gspo", *sys.argv[3:]]
runpy.run_module("trl_gspo.launch.cli", run_name="__main__", alter_sys=True)
"""


def test_an_unreachable_hub_costs_the_readme_dry_run_one_probe(tmp_path):
    """The README's dry run of the flagship recipe, with HF_HUB_OFFLINE unset and the Hub unreachable (HF_ENDPOINT
    at a closed local port, so on any machine): one connection attempt, then the cache only, instead of five retries
    with backoff per request (about 30 s, of which 23 s sleeping); it passes, listing the hub model and dataset it
    could not check. A subprocess: the offline switches are read at import. What made it slow is counted, not timed
    (a busy machine stretches the imports, not the retries): the run's connection attempts to the Hub and the
    seconds it slept."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from support.helpers import cpu_env

    port = _closed_port()
    env = cpu_env(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))  # nothing cached
    for name in [name for name in env if name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
                 or name.lower().endswith("_proxy")]:
        del env[name]
    root = Path(__file__).resolve().parents[1]
    record = tmp_path / "record.json"
    result = subprocess.run([sys.executable, "-c", _COUNTING_CLI, str(record), str(port), "--config",
                             "recipes/qwen3_30b_a3b/gspo.yaml", "--dry_run", "true"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    block = result.stdout.split("not checked on this machine (the Hub: it cannot be reached, 127.0.0.1:")[1]
    assert block.splitlines()[0].endswith("Connection refused); the run checks them when it starts:"), block
    for line in ("  model_name_or_path  Qwen/Qwen3-30B-A3B-Base: that it exists",
                 "  dataset_name        trl-lib/DeepMath-103K: that it exists"):
        assert line in block, block
    assert "Retrying" not in result.stderr and "Retrying" not in result.stdout
    # one probe, then the cache only; without the probe: 8 attempts and 23 s of backoff asked of time.sleep
    did = json.loads(record.read_text())
    assert len(did["connects"]) == 1 and did["slept"] < 1, did
    assert not os.path.exists(tmp_path / "hf" / "datasets" / "trl-lib___deep_math-103_k")


def test_an_unreachable_hub_refuses_a_run(tmp_path, capsys, monkeypatch, no_model):
    """With the Hub unreachable (HF_HUB_OFFLINE unset), a run is refused before launch, naming the network; a dry run
    lists the dataset instead (the subprocess test above, for the README's recipe)."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("trl_gspo.launch.checks.hub_unreachable_once", lambda endpoint: "127.0.0.1:9: refused")
    recipe = _recipe(tmp_path, replace=[("builtin:addition", "trl-gspo-tests/no-such-dataset")])
    assert main([recipe]) == 2
    err = capsys.readouterr().err
    assert ("`dataset_name`: 'trl-gspo-tests/no-such-dataset' is neither a local path nor a cached dataset, and the "
            "Hub cannot be reached from here (127.0.0.1:9: refused). Fix: check the network") in err, err
    assert main([recipe, "--dry_run", "true"]) == 0
    assert "(the Hub: it cannot be reached, 127.0.0.1:9: refused)" in capsys.readouterr().out


def test_the_hub_probe_answers_within_its_timeout(monkeypatch):
    """A Hub that accepts the connection, one that refuses it, and one that never answers: the probe gives up after
    its own timeout while the connection attempt is still hanging (its thread is left behind, a daemon)."""
    import socket
    import threading
    import time

    from huggingface_hub import constants

    from trl_gspo.trainer.model_checks import hub_unreachable

    for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as server:  # a local "Hub" that accepts connections
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_unreachable() is None
    monkeypatch.setattr(constants, "ENDPOINT", f"https://127.0.0.1:{_closed_port()}")
    assert "Connection refused" in hub_unreachable()
    hang, attempts, ended, joins = threading.Event(), [], [], []

    def never_answers(address, timeout=None, *args, **kwargs):
        attempts.append(timeout)
        hang.wait(60)  # until the test releases it
        ended.append(True)
        raise OSError("released by the test")

    class Thread(threading.Thread):
        def join(self, timeout=None):
            joins.append(timeout)
            super().join(timeout)

    monkeypatch.setattr(socket, "create_connection", never_answers)
    monkeypatch.setattr(threading, "Thread", Thread)
    started = time.perf_counter()
    try:
        assert hub_unreachable(timeout=0.2).endswith("no answer within 0.2 s")
        waited = time.perf_counter() - started
        # it waited for the attempt no longer than its timeout and returned while the attempt still hung (which had
        # the timeout as its socket's too): counted, so a busy machine cannot fail it
        assert joins == [0.2] and attempts == [0.2] and not ended
        # a backstop: far sooner than the hung attempt ends (60 s), though 100 times the timeout
        assert waited < 20, waited
    finally:
        hang.set()


def test_a_dataset_mixture_entry_that_is_not_reachable(tmp_path, capsys, no_model):
    recipe = _recipe(tmp_path, replace=[("dataset_name: builtin:addition\n", "")],
                     extra="datasets:\n  - path: trl-gspo-tests/no-such-dataset\n")
    _refused_at_launch_listed_by_a_dry_run(capsys, recipe, "datasets", "trl-gspo-tests/no-such-dataset")


def test_dataset_name_and_datasets_together(tmp_path, capsys, no_model):
    recipe = _recipe(tmp_path, extra="datasets:\n  - path: trl-gspo-tests/other\n")
    _refused(capsys, [recipe], "both `dataset_name` ('builtin:addition') and `datasets` are set")


def test_the_launched_entry_point_reports_a_bad_recipe_in_one_line(tmp_path, capsys, no_model):
    from trl_gspo.launch.train import main as train_main

    assert train_main([_recipe(tmp_path), "--num_generations", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("trl-gspo: error: `num_generations` must be >= 2, got 0. Fix: "
                                               "e.g. num_generations=8.")


def test_a_dotted_reward_that_is_not_callable(tmp_path, capsys, no_model):
    recipe = _recipe(tmp_path, replace=[("[digit_match_reward]", "[os.sep]")])
    _refused(capsys, [recipe], "`reward_funcs`", "'os.sep' is a str, not a function")


def test_reward_funcs_written_as_a_string(tmp_path, capsys, no_model):
    recipe = _recipe(tmp_path, replace=[("[digit_match_reward]", "exact_match_reward")])
    _refused(capsys, [recipe], "`reward_funcs` must be a list", "reward_funcs: [exact_match_reward]")


def test_trl_reward_factories_need_arguments(tmp_path, capsys, no_model):
    recipe = _recipe(tmp_path, replace=[("[digit_match_reward]", "[get_cosine_scaled_reward]")])
    _refused(capsys, [recipe], "`reward_funcs`: get_cosine_scaled_reward is TRL's factory")


@pytest.mark.parametrize("key,value,minimum", [("per_device_train_batch_size", 0, 1),
                                               ("gradient_accumulation_steps", 0, 1),
                                               ("num_generations", 0, 2),  # a ZeroDivisionError inside TRL before
                                               ("num_generations", 1, 2),
                                               ("steps_per_generation", 0, 1),
                                               ("num_iterations", 0, 1),
                                               ("max_completion_length", 0, 1)])
def test_impossible_sizes(tmp_path, capsys, no_model, key, value, minimum):
    _refused(capsys, [_recipe(tmp_path), f"--{key}", str(value)], f"`{key}` must be >= {minimum}, got {value}")


@pytest.mark.parametrize("key,value", [("learning_rate", "-1e-3"), ("temperature", "0")])
def test_impossible_values(tmp_path, capsys, no_model, key, value):
    _refused(capsys, [_recipe(tmp_path), f"--{key}={value}"], f"`{key}` must be")


@pytest.mark.parametrize("argv,needle", [(["--max_steps", "many"], "invalid int value: 'many'"),
                                         (["--learning_rate", "-1e-3"], "`--key=-1e-3`")])
def test_a_value_argparse_cannot_read_is_one_line(tmp_path, capsys, no_model, argv, needle):
    _refused(capsys, [_recipe(tmp_path), *argv], f"argument {argv[0]}", needle)


@pytest.mark.parametrize("argv,needle", [
    (["--max_steps", "0", "--num_train_epochs", "0"], "`max_steps` must be -1 or >= 1, got 0"),
    (["--max_steps", "-5"], "`max_steps` must be -1 or >= 1, got -5"),  # transformers would train by epochs
    (["--num_train_epochs", "0"], "`num_train_epochs` must be > 0, got 0"),
])
def test_nothing_to_train(tmp_path, capsys, no_model, argv, needle):
    _refused(capsys, [_recipe(tmp_path), *argv], needle, "Fix: e.g.")  # in the dry run, before anything loads


@pytest.mark.parametrize("broken,where,needle", [
    ("reward_funcs: [a, b\n", ":10:1:", "that starts at line 9, column 15"),  # an unclosed list
    ("output_dir: x\n  bad: indent\n", ":10:6:", "mapping values are not allowed here"),
])
def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys, no_model, broken, where, needle):
    recipe = _recipe(tmp_path, extra=broken)
    err = _refused(capsys, [recipe], "YAML syntax error", needle)
    assert err.startswith(f"trl-gspo: error: {recipe}{where}")


def test_a_gpu_recipe_on_a_machine_without_one(tmp_path, capsys, no_model, fake_accelerator):
    """bf16 cannot even be parsed without a GPU (transformers refuses it); the launch is refused with the fix, and a
    dry run validates the recipe anyway. No GPU is faked, so this runs on a GPU machine too."""
    fake_accelerator(False)
    recipe = _recipe(tmp_path, replace=[("use_cpu: true\nbf16: false\n", "bf16: true\n")])
    assert main([recipe]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trl-gspo: error: `bf16: true` needs a GPU") and "--bf16 false --use_cpu true" in err
    assert main([recipe, "--dry_run", "true"]) == 0
    assert "no GPU here: validated with use_cpu=true, bf16=false" in capsys.readouterr().out


def test_no_arguments_prints_usage(capsys, no_model):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trl-gspo RECIPE.yaml") and "bf16" not in err


def test_a_recipe_path_without_config_flag(tmp_path, capsys, no_model):
    assert main([_recipe(tmp_path), "--dry_run", "true"]) == 0
    assert "recipe is valid" in capsys.readouterr().out
    _refused(capsys, [str(tmp_path / "missing.yaml")], "does not exist", "--config recipes/quickstart.yaml")


@pytest.mark.parametrize("argv,needle", [(["{recipe}", "--dry_run", "true", "stray"], "unexpected `stray`"),
                                         (["--max_steps", "3", "{recipe}"], "a recipe path goes first")])
def test_a_stray_argument(tmp_path, capsys, no_model, argv, needle):
    recipe = _recipe(tmp_path)
    _refused(capsys, [token.format(recipe=recipe) for token in argv], needle)


def test_accelerate_options_and_their_values_are_not_stray(tmp_path, capsys, no_model):
    argv = [_recipe(tmp_path), "--num_processes", "1", "--mixed_precision", "no", "--main_process_port=29999",
            "--dynamo_backend", "no", "--dry_run", "true"]
    assert main(argv) == 0, capsys.readouterr().err


def test_a_dataset_smaller_than_one_rollout_batch(tmp_path, capsys, no_model):
    """Before launch, with the launch's process count: 8 per device x 2 processes x 4 mini-batches = 64 completions
    = 8 prompts of 8 generations per rollout batch; 7 prompts would give 0 optimizer steps."""
    recipe = _recipe(tmp_path, extra="builtin_num_examples: 7\n")
    _refused(capsys, [recipe, "--num_processes", "2"], "the training split has 7 prompts",
             "8 prompts x 8 generations = 64 completions", "builtin_num_examples")
    assert main([recipe, "--num_processes", "1", "--dry_run", "true"]) == 0  # 4 prompts per rollout batch fit


def test_a_loaded_dataset_smaller_than_one_rollout_batch_is_refused_before_the_model(tmp_path, capsys, no_model):
    """A dataset whose size is only known once loaded (here a local JSON file through TRL's dataset mixture): the
    launched entry point refuses it after loading it, before building the model."""
    from trl_gspo.launch.train import main as train_main

    data = tmp_path / "prompts.json"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1="}) for i in range(3)))
    recipe = _recipe(tmp_path, replace=[("dataset_name: builtin:addition\n", "")],
                     extra=f"datasets:\n  - path: json\n    data_files: {data}\n")
    assert main([recipe, "--dry_run", "true"]) == 0  # its size is unknown before loading
    capsys.readouterr()
    assert train_main([recipe]) == 2
    err = capsys.readouterr().err
    assert "the training split has 3 prompts, fewer than one rollout batch: 4 prompts" in err
    assert not (tmp_path / "out").exists()


def test_a_split_the_dataset_does_not_have(tmp_path, capsys, no_model):
    from trl_gspo.launch.train import main as train_main

    data = tmp_path / "prompts.json"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1="}) for i in range(64)))
    recipe = _recipe(tmp_path, replace=[("dataset_name: builtin:addition\n", "")],
                     extra=f"datasets:\n  - path: json\n    data_files: {data}\n")
    assert train_main([recipe, "--dataset_train_split", "training"]) == 2
    assert "`dataset_train_split`: the dataset has no split 'training' (it has ['train'])" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value,kind", [("epsilon", "3e-4", "a number"), ("beta", True, "a number"),
                                              ("steps_per_generation", 2.5, "an integer"),
                                              ("routing_replay_offload", "yes", "a bool"),
                                              ("loss_type", 3, "a string")])
def test_gspo_config_names_a_field_of_the_wrong_type(field, value, kind):
    with pytest.raises(TypeError, match=rf"^`{field}` must be {kind}, got {value!r}.*Fix: pass {kind}"):
        GSPOConfig(output_dir="unused", use_cpu=True, report_to="none", **{field: value})
