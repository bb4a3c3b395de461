"""`trl-gspo vllm-serve`: TRL's vLLM server (`trl vllm-serve`, same arguments) that also returns MoE routes.

TRL 1.16's `trl vllm-serve` runs vLLM's own OpenAI-compatible server (`vllm serve`, with TRL's weight-transfer and
log-prob settings). vLLM returns each completion's `routed_experts` in its `/v1/completions` answer when the server is
started with `--enable-return-routed-experts`; TRL's client reads the tokens and log-probs of that answer and the
trainer reads the routes of the same answer (`trl_gspo.sampling.vllm.capture_routes`). This command is TRL's
`build_command` with that one flag added, so routing replay from the sampler (`routing_replay="sampler"`) works in
server mode:

    CUDA_VISIBLE_DEVICES=4,5,6,7 trl-gspo vllm-serve --model Qwen/Qwen3-30B-A3B --tensor-parallel-size 4

Any argument `trl vllm-serve` does not know is passed to `vllm serve` as it is (TRL's own behaviour). It is meant
for Mixture-of-Experts models; a dense model has no routes to return, so serve it with `trl vllm-serve` (whether vLLM
accepts the flag for a dense model was not tried). vLLM refuses the flag with pipeline parallelism.
"""

from __future__ import annotations

import os
import shlex
import sys

from .vllm import SERVER_ROUTES_FLAG


def server_command(argv: list[str]) -> list[str]:
    """The `vllm serve` command line (starting with the Python executable) for `trl-gspo vllm-serve ARGV`."""
    from trl.scripts.vllm_serve import build_command, make_parser

    script_args, extra_args = make_parser(prog="trl-gspo vllm-serve").parse_args_and_config(
        args=argv, return_remaining_strings=True)
    extra_args = list(extra_args or [])
    if SERVER_ROUTES_FLAG not in extra_args:
        extra_args.append(SERVER_ROUTES_FLAG)
    return build_command(script_args, extra_args)


def main(argv: list[str]) -> int:
    """Replace this process with the server (as `trl vllm-serve` does); prints the equivalent `vllm serve` line."""
    command = server_command(argv)
    print("trl-gspo vllm-serve: VLLM_SERVER_DEV_MODE=1 " + shlex.join(["vllm", *command[command.index("serve"):]]),
          file=sys.stderr, flush=True)
    # TRL's client uses the weight-transfer and prefix-cache endpoints, which vLLM serves in its dev mode only.
    os.execve(sys.executable, command, dict(os.environ, VLLM_SERVER_DEV_MODE="1"))
    return 1  # not reached
