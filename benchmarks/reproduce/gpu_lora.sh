#!/usr/bin/env bash
# The LoRA checks at the flagship's layer widths as one bounded command, for a bare one-GPU machine:
#   bash benchmarks/reproduce/gpu_lora.sh [OUT_DIR] [COMMIT]     # on the GPU machine, from the repo root
# (the packages the GPU image lacks as wheels in .whl/, as gpu_acceptance.sh's header says). The benchmarks have
# the GPU to themselves (timed ratios and allocator peaks); `pytest -m gpu` runs last. Ends within about 480 s.
# Logs: env.txt, bench.log, gpu_tests.log.
set -u
OUT_DIR=${1:-outputs/gpu_lora}
COMMIT=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# shellcheck source=benchmarks/reproduce/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"
write_env > "$OUT_DIR/env.txt" 2>&1
{
  stamp lora_sync
  timeout 90 python3 benchmarks/lora_sync.py --size gpu --repeats 5
  stamp lora_rollout
  timeout 150 python3 benchmarks/lora_rollout.py --size gpu --step-memory 4096,256 --step-batch 2
  stamp routing_replay_overhead
  timeout 100 python3 benchmarks/routing_replay_overhead.py --size gpu --repeats 41 --profile 3
  stamp done
} > "$OUT_DIR/bench.log" 2>&1
left=$(( 470 - ($(date +%s) - started) ))
(stamp "pytest -m gpu"; timeout $left python3 -m pytest -m gpu -n 3 -p no:cacheprovider -q --durations=0; \
  stamp "rc $?") > "$OUT_DIR/gpu_tests.log" 2>&1
stamp "all done" >> "$OUT_DIR/env.txt"
