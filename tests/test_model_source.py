"""Where a model comes from, offline: a Hub id is refused in one line only when transformers surely cannot load it, so
every other place transformers looks passes (a `cache_dir`, a pinned `revision` with no refs/main, a `subfolder`, a
recipe's `model_revision`), and its config is read from there with the `token` given; a recipe's `builtin:` name is
refused by the trainers in one line that names how to build the model in Python.

Each Hub model is a tiny Qwen3 saved in the Hub cache's layout (models--ORG--NAME/snapshots/SHA, refs/main) under a
temporary directory, with HF_HUB_OFFLINE on; transformers itself loads it from there, or fails, as the check says."""

import os
import textwrap

import pytest
import transformers
import trl
from huggingface_hub import constants
from support.helpers import BASE_RECIPE, digit_reward, tiny_config, toy_dataset

from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer, GSPOTrainer
from trl_gspo.trainer.model_checks import (
    ModelSourceError,
    check_model_source,
    model_config,
)

SHA = "0123456789abcdef0123456789abcdef01234567"  # the commit a snapshot holds


def _tiny_model():
    config = transformers.Qwen3Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """`hub(repo, cache=None, refs_main=True, subfolder=None)` saves the tiny model as the Hub cache holds `repo` (the
    default cache unless `cache` is given); offline mode is on and the default cache is empty otherwise."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    tiny_model = _tiny_model()

    def put(repo, cache=None, refs_main=True, subfolder=None):
        folder = os.path.join(cache or constants.HF_HUB_CACHE, "models--" + repo.replace("/", "--"))
        snapshot = os.path.join(folder, "snapshots", SHA)
        tiny_model.save_pretrained(os.path.join(snapshot, subfolder) if subfolder else snapshot)
        if refs_main:
            os.makedirs(os.path.join(folder, "refs"))
            with open(os.path.join(folder, "refs", "main"), "w") as ref:
                ref.write(SHA)

    return put


def _loads(repo, **options) -> bool:
    """Whether transformers loads `repo` with these `from_pretrained` options."""
    try:
        transformers.AutoModelForCausalLM.from_pretrained(repo, **options)
    except OSError:
        return False
    return True


def _args(tmp_path, **init):
    return tiny_config(tmp_path / "out", model_init_kwargs=init or None)


@pytest.mark.parametrize("place", ["cache_dir", "revision", "subfolder"])
def test_a_model_transformers_loads_from_another_cache_place_passes_and_its_config_is_read_there(place, hub,
                                                                                                  tmp_path):
    """Cached under a `cache_dir`, only at a pinned revision (no refs/main), or in a subfolder: with the option in
    `model_init_kwargs` the check passes and the config is read (the MoE checks need it); without it transformers
    fails too, and the refusal names the place looked in and the fix."""
    options = {"cache_dir": str(tmp_path / "elsewhere"), "revision": SHA, "subfolder": "policy"}[place]
    options = {place: options}
    hub("org/tiny", cache=options.get("cache_dir"), refs_main=place != "revision", subfolder=options.get("subfolder"))
    assert _loads("org/tiny", **options)
    assert type(model_config("org/tiny", _args(tmp_path, **options))).__name__ == "Qwen3Config"

    assert not _loads("org/tiny")
    with pytest.raises(ModelSourceError) as refused:
        model_config("org/tiny", _args(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("`model`: 'org/tiny' is neither a local path nor a cached "
                                                      "model, and offline mode is on (HF_HUB_OFFLINE). Fix: "), message
    if place == "revision":  # the snapshot that is there is named, with the option that selects it
        assert f"set the revision to one cached ({SHA}: `revision` in model_init_kwargs" in message, message


def test_a_model_missing_from_every_place_is_refused_in_one_line_naming_where_and_the_fix(hub, tmp_path):
    hub("org/tiny")  # another model is cached: not this one
    elsewhere = str(tmp_path / "elsewhere")
    options = {"cache_dir": elsewhere, "revision": SHA, "subfolder": "policy", "token": "hf_secret"}
    assert not _loads("org/not-here", **options)
    with pytest.raises(ModelSourceError) as refused:
        model_config("org/not-here", _args(tmp_path, **options))
    message = str(refused.value)
    assert "\n" not in message and "hf_secret" not in message, message
    assert message == (f"`model`: 'org/not-here' is neither a local path nor a cached model (cache_dir={elsewhere!r}, "
                       f"revision={SHA!r}, subfolder='policy'), and offline mode is on (HF_HUB_OFFLINE). Fix: give a "
                       f"local path, or download it once online (`hf download org/not-here --revision {SHA} "
                       f"--cache-dir {elsewhere}`).")


def test_the_token_reaches_the_config_read(hub, tmp_path, monkeypatch):
    """A gated or private model's config is read with the `token` of `model_init_kwargs`, as TRL loads the model."""
    hub("org/tiny")
    asked = []
    read = transformers.AutoConfig.from_pretrained

    def recorded(name, **kwargs):
        asked.append(kwargs)
        return read(name, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", recorded)
    assert model_config("org/tiny", _args(tmp_path, token="hf_secret")) is not None
    assert [kwargs.get("token") for kwargs in asked] == ["hf_secret"]


def test_local_files_only_is_refused_like_offline_mode(monkeypatch, tmp_path):
    """A Hub that accepts connections, and `local_files_only`: transformers will not ask it, so a model it has not
    cached is refused at once."""
    import socket

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with socket.socket() as server:  # a local "Hub" that accepts connections
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        check_model_source("org/not-here")  # the Hub may serve it
        with pytest.raises(ModelSourceError, match=r"^`model`: 'org/not-here' is neither a local path nor a cached "
                                                   r"model, and local_files_only is set\. Fix: give a local path"):
            model_config("org/not-here", _args(tmp_path, local_files_only=True))


@pytest.mark.parametrize("where", ["model_revision: {sha}\n", 'model_init_kwargs: {{"cache_dir": "{cache}"}}\n'])
def test_a_recipe_probes_the_model_where_the_run_will_load_it(where, hub, tmp_path):
    """A recipe's Hub model cached at its `model_revision` only (no refs/main), or under its `model_init_kwargs`
    cache_dir, passes the checks `trl-gspo` runs before it launches; without those keys it is refused in one line
    naming the key."""
    from trl_gspo.launch.checks import check_recipe
    from trl_gspo.launch.recipe import RecipeError, parse_recipe

    cache = str(tmp_path / "elsewhere")
    hub("org/tiny", cache=cache if "cache_dir" in where else None, refs_main="cache_dir" in where)
    body = textwrap.dedent(BASE_RECIPE.replace("builtin:tiny-qwen3-moe", "org/tiny").format(out=tmp_path / "out"))
    recipe = tmp_path / "recipe.yaml"
    for text in (body + where.format(sha=SHA, cache=cache), body):
        recipe.write_text(text)
        script_args, training_args, model_args, dataset_args, launch_args, _ = parse_recipe([str(recipe)],
                                                                                            before_launch=True)
        if text != body:
            check_recipe(script_args, training_args, model_args, dataset_args, launch_args)
            continue
        with pytest.raises(RecipeError) as refused:
            check_recipe(script_args, training_args, model_args, dataset_args, launch_args)
        message = str(refused.value)
        assert "\n" not in message and message.startswith("`model_name_or_path`: 'org/tiny' is neither a local path "
                                                          "nor a cached model"), message


def test_the_trainers_refuse_a_builtin_name_in_one_line_naming_how_to_build_it(tmp_path, monkeypatch):
    """`builtin:` names are the recipes' (`trl-gspo` builds them); the trainers refuse one before TRL loads anything,
    naming the quickstart builder; the model and tokenizer that builder gives make a GSPOTrainer."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from trl_gspo.launch.recipe import BUILTIN_MODELS, BUILTIN_PREFIX
    from trl_gspo.trainer import model_checks

    def loaded(*args, **kwargs):
        pytest.fail("TRL was asked to load a `builtin:` name")

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", loaded)
    monkeypatch.setattr(AsyncGRPOTrainer, "__init__", loaded)
    for name in BUILTIN_MODELS:
        with pytest.raises(ValueError) as refused:
            GSPOTrainer(model=BUILTIN_PREFIX + name, reward_funcs=digit_reward, args=tiny_config(tmp_path),
                        train_dataset=toy_dataset())
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"`model`: 'builtin:{name}' is a built-in model of "
                                                           "`trl-gspo` recipes"), message
        assert f"Fix: build it with trl_gspo.quickstart ({model_checks.BUILTIN_BUILDERS[name]})" in message, message
        with pytest.raises(ValueError, match=f"^`model`: 'builtin:{name}' is a built-in model.*AsyncGSPOTrainer: "
                                             "the directory both are saved to"):
            AsyncGSPOTrainer(model=BUILTIN_PREFIX + name, reward_funcs=digit_reward, train_dataset=toy_dataset(),
                             args=AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    monkeypatch.undo()
    # the library knows the recipes' names without importing the command side
    assert model_checks.BUILTIN_PREFIX == BUILTIN_PREFIX and set(model_checks.BUILTIN_BUILDERS) == set(BUILTIN_MODELS)

    # the fix, as the message writes it: a model and tokenizer GSPOTrainer takes
    from trl_gspo.quickstart.model import build_dense_model
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    built = {"build_dense_model": build_dense_model, "build_tokenizer": build_tokenizer}
    exec(model_checks.BUILTIN_BUILDERS["tiny-qwen3"], built)  # noqa: S102  the message's own code
    trainer = GSPOTrainer(model=built["model"], reward_funcs=digit_reward, args=tiny_config(tmp_path, max_steps=1),
                          train_dataset=toy_dataset(), processing_class=built["tokenizer"])
    assert trainer.processing_class is built["tokenizer"]

