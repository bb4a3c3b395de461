"""Checks of a model's configuration against what TRL will do with it, run when `GSPOTrainer` is constructed, so
that an unsupported combination fails in a second instead of after the model has loaded and generated; and of where
the model comes from: a name that is neither local, nor cached where transformers looks (`model_init_kwargs`'
cache_dir, revision, subfolder), nor reachable on the Hub is refused in one line before transformers' retries (about
30 s, 51 s for a model's files), the Hub probed once, bounded in time; so is a recipe's `builtin:` name (also used by
the recipe checks and `AsyncGSPOTrainer`).

Knows no trainer: takes a transformers config and the training arguments.
"""

from __future__ import annotations

import functools
import os


def check_model(model, args) -> None:
    """Every construction-time check of `model` (an object, or a hub id / path read as a config only)."""
    config = model_config(model, args)
    if config is not None:
        check_moe_aux_loss(config, args)
    if not isinstance(model, str):
        check_trl_backbone(model)


def aux_loss_enabled(text_config, args) -> bool:
    """TRL 1.16's rule (`GRPOTrainer.__init__`): the MoE load-balancing loss is added when the config can return
    router logits and the coefficient (the argument, else the config's own, else 0) is non-zero."""
    coef = args.router_aux_loss_coef
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    return hasattr(text_config, "output_router_logits") and coef != 0.0


def check_moe_aux_loss(config, args) -> None:
    """Refuse a MoE whose load-balancing loss TRL would compute but cannot.

    TRL 1.16 computes the aux loss in its fused log-prob path from `config.num_experts` and
    `config.num_experts_per_tok`. Families that name the expert count otherwise (GraniteMoE and Llama4:
    `num_local_experts`; DeepSeek-V3 and GLM-4-MoE: `n_routed_experts`) fail there with an AttributeError, on the
    first scoring pass, after the first generation (docs/results.md#on-one-h100). Raises `ValueError` naming the
    option and the fix.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not aux_loss_enabled(text_config, args):
        return
    missing = [name for name in ("num_experts", "num_experts_per_tok") if not hasattr(text_config, name)]
    if missing:
        raise ValueError(
            f"`router_aux_loss_coef`: {type(config).__name__} enables the MoE load-balancing loss (router_aux_loss_coef="
            f"{getattr(text_config, 'router_aux_loss_coef', None)} in the model config), which TRL computes from "
            f"config.{' and config.'.join(missing)}, absent on this architecture: training would fail at the first "
            "scoring pass. Fix: set router_aux_loss_coef=0 in the training arguments (GSPOConfig / the recipe) to "
            "train without the aux loss."
        )


def check_trl_backbone(model) -> None:
    """Refuse a model object whose backbone TRL's fused log-prob path cannot find.

    TRL 1.16 scores completions through `model.base_model` (the submodule named by `base_model_prefix`) and its LM
    head. When the prefix names no submodule, `base_model` is the model itself and every scoring pass fails
    (measured: transformers' text-only `Llama4ForCausalLM`, prefix "language_model", backbone at `.model`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT-wrapped model
    if getattr(inner, "base_model", None) is inner and hasattr(inner, "lm_head"):
        raise ValueError(
            f"`model`: {type(inner).__name__}.base_model_prefix={inner.base_model_prefix!r} names no submodule, so "
            "TRL's log-prob path (every GRPO/GSPO scoring pass) cannot find the model's backbone and would fail at the "
            "first step. Fix: load the checkpoint with a class whose base_model_prefix names its backbone (for "
            "Llama 4, Llama4ForConditionalGeneration), or use another architecture."
        )


def model_config(model, args):
    """The transformers config of `model` (a model object or a hub id / path) without loading weights, or None when
    it cannot be read here (TRL then reports the problem itself). Read from where TRL will load the model:
    `model_init_kwargs`' cache_dir, revision, subfolder and token."""
    if not isinstance(model, str):
        return getattr(model, "config", None)
    from transformers import AutoConfig

    init = args.model_init_kwargs or {}
    where = hub_options(init)
    check_model_source(model, **where)  # neither local, nor cached, nor reachable: one line, before any retry
    try:
        return AutoConfig.from_pretrained(model, **where,
                                          trust_remote_code=init.get("trust_remote_code", args.trust_remote_code))
    except (OSError, ValueError):
        return None


# Seconds the checks wait for the Hub to accept a connection before they treat it as unreachable and read the cache
# only. Without this, each Hub request retries five times with backoff (about 30 s) before it fails.
HUB_PROBE_TIMEOUT = 3.0


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT) -> str | None:
    """Why the Hub cannot be reached from here (no such host, connection refused, no answer within `timeout`
    seconds), or None when its endpoint (`HF_ENDPOINT`, or the proxy the environment names for it) accepts a TCP
    connection. One attempt, bounded in time, name lookup included."""
    import socket
    import threading
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    url = urllib.parse.urlsplit(constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        parsed = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    outcome = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{host}:{port}: {err.strerror or err}")

    probe = threading.Thread(target=connect, daemon=True)  # a name lookup can outlast the socket's timeout
    probe.start()
    probe.join(timeout)
    return outcome[0] if outcome else f"{host}:{port}: no answer within {timeout:g} s"


@functools.lru_cache(maxsize=None)
def hub_unreachable_once(endpoint: str) -> str | None:
    """`hub_unreachable()`, asked once per process and Hub endpoint: every dataset of a recipe shares the answer, so
    an unreachable Hub costs one probe's timeout, not one per dataset."""
    return hub_unreachable()


class ModelSourceError(OSError, ValueError):
    """A model name that is neither local, nor cached, nor reachable: an `OSError` where transformers would raise one
    after its retries, and a `ValueError` like the other refusals of a bad option."""


# `from_pretrained`'s keywords that say where a model's files are, with their defaults: transformers reads
# `<cache_dir or HF_HUB_CACHE>/models--ORG--NAME/snapshots/<revision>/<subfolder>/config.json` when it cannot ask the
# Hub, or may not (`local_files_only`); `token` opens a gated or private repository.
WHERE_KEYS = {"cache_dir": None, "revision": "main", "subfolder": "", "token": None, "local_files_only": False}


def hub_options(init_kwargs: dict | None) -> dict:
    """The keywords of `init_kwargs` (`model_init_kwargs`, what TRL passes to `from_pretrained`) that say where the
    model's files are, without those at their defaults."""
    return {key: value for key, value in (init_kwargs or {}).items()
            if key in WHERE_KEYS and value is not None and value != WHERE_KEYS[key]}


# The recipes' built-in models, and how Python builds them (trl_gspo.quickstart): only `trl-gspo` builds them by name.
# Here, not in trl_gspo/launch/recipe.py (which imports them), because the trainers refuse the names and may not
# import the launch side.
BUILTIN_PREFIX = "builtin:"
BUILTIN_BUILDERS = {
    "tiny-qwen3-moe": "tokenizer = build_tokenizer(); model = build_model(tokenizer)",
    "tiny-qwen3": "tokenizer = build_tokenizer(); model = build_dense_model(tokenizer)",
    "tiny-qwen3-moe-tools": "model, tokenizer = build_tool_model()",
}


def check_model_source(model: str, key: str = "model", *, cache_dir=None, revision=None, subfolder=None, token=None,
                       local_files_only=False) -> None:
    """Refuse, in one line naming `key`, a model name transformers surely cannot load: a `builtin:` name (only
    `trl-gspo` recipes build those), or a Hub id that is neither a local path, nor in the cache where transformers
    looks (`cache_dir`, else HF_HUB_CACHE; at `revision`, in `subfolder`), nor reachable (offline mode,
    `local_files_only`, or a Hub that does not accept a connection within `HUB_PROBE_TIMEOUT` seconds), before
    transformers' retry loop and traceback. A name the Hub can serve passes: transformers reports a wrong one. `token`
    changes nothing here (the cache needs none; a Hub that answers is asked with it by transformers)."""
    if os.path.exists(model):
        return
    if model.startswith(BUILTIN_PREFIX):
        builder = BUILTIN_BUILDERS.get(model[len(BUILTIN_PREFIX):], BUILTIN_BUILDERS["tiny-qwen3-moe"])
        raise ValueError(f"`{key}`: {model!r} is a built-in model of `trl-gspo` recipes, which the trainers do not "
                         f"build. Fix: build it with trl_gspo.quickstart ({builder}) and pass model=model, "
                         "processing_class=tokenizer (docs/own_task.md#from-python; AsyncGSPOTrainer: the directory "
                         "both are saved to), or train it with `trl-gspo` and a recipe.")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except ValueError:  # a path that does not exist, not a Hub id: transformers says so at once, without retries
        return
    folder = f"{subfolder}/" if subfolder else ""
    # a PEFT adapter's repository holds adapter_config.json instead: transformers loads its base model then
    for name in ("config.json", "adapter_config.json"):
        if isinstance(try_to_load_from_cache(model, folder + name, cache_dir=cache_dir, revision=revision), str):
            return
    where = ", ".join(f"{name}={value!r}" for name, value in
                      (("cache_dir", cache_dir), ("revision", revision), ("subfolder", subfolder)) if value)
    where = f" ({where})" if where else ""
    elsewhere = _cached_revisions(model, folder, cache_dir)
    download = " ".join([f"hf download {model}", *([f"--revision {revision}"] if revision else []),
                         *([f"--cache-dir {cache_dir}"] if cache_dir else [])])
    fix = (f"set the revision to one cached ({', '.join(elsewhere)}: `revision` in model_init_kwargs, "
           "`model_revision` in a recipe), " if elsewhere else "")
    fix += f"give a local path, or download it once online (`{download}`)."
    if constants.HF_HUB_OFFLINE or local_files_only:
        why = "offline mode is on (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE else "local_files_only is set"
        raise ModelSourceError(f"`{key}`: {model!r} is neither a local path nor a cached model{where}, and {why}. "
                               f"Fix: {fix}")
    unreachable = hub_unreachable_once(constants.ENDPOINT)
    if unreachable:
        raise ModelSourceError(f"`{key}`: {model!r} is neither a local path nor a cached model{where}, and the Hub "
                               f"cannot be reached from here ({unreachable}). Fix: check the network (or HF_ENDPOINT, "
                               f"a proxy), {fix}")


def _cached_revisions(model: str, folder: str, cache_dir) -> list[str]:
    """The snapshots (commit hashes) of `model` in the cache that hold its config, or []."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    snapshots = os.path.join(cache_dir or constants.HF_HUB_CACHE, repo_folder_name(repo_id=model, repo_type="model"),
                             "snapshots")
    found = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
    return [sha for sha in found if os.path.isfile(os.path.join(snapshots, sha, folder, "config.json"))]
