#!/usr/bin/env bash
# The GPU acceptance run (docs/gpus.md) as one bounded command, for a bare one-GPU machine with a short time limit:
#   (on a CPU machine first: `pip download`/`pip wheel` the packages the GPU image lacks into .whl/: trl,
#    transformers, datasets, deepspeed and their small dependencies; docs/results.md 'On one H200' lists them)
#   bash benchmarks/reproduce/gpu_acceptance.sh [OUT_DIR] [COMMIT]     # on the GPU machine, from the repo root
# Phases 1 and 3 have the GPU to themselves (timed ratios, step shares); phase 2 runs the acceptance suite, the CPU test suite and the
# untimed benchmarks side by side. Every step has a timeout, so the whole run ends within about 580 s; each log says
# where a step stopped. Logs: env.txt, bench.log, gpu_tests.log, cpu_tests.log, side.log.
set -u
OUT_DIR=${1:-outputs/gpu_acceptance}
COMMIT=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# shellcheck source=benchmarks/reproduce/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"
write_env > "$OUT_DIR/env.txt" 2>&1

# Phase 1: the GPU to itself.
{
  stamp routing_replay_overhead
  timeout 100 python3 benchmarks/routing_replay_overhead.py --size gpu --repeats 41 --profile 3
  stamp loss_overhead
  timeout 80 python3 benchmarks/loss_overhead.py --size gpu --device cuda --repeats 41
  stamp lora_rollout
  timeout 120 python3 benchmarks/lora_rollout.py --size gpu --step-memory 4096,256 --step-batch 2
  stamp done
} > "$OUT_DIR/bench.log" 2>&1

# Phase 2: side by side (the CPU suite pins itself to the CPU; the untimed benchmarks share the GPU).
left=$(( 560 - ($(date +%s) - started) ))
(stamp "pytest -m gpu"; timeout $((left - 10)) python3 -m pytest -m gpu -n 3 -p no:cacheprovider -q \
  --durations=0; stamp "rc $?") > "$OUT_DIR/gpu_tests.log" 2>&1 &
(stamp "pytest (the README's test command, 8 workers)"; OMP_NUM_THREADS=2 timeout $((left - 10)) python3 -m pytest \
  -n 8 -p no:cacheprovider -q --maxfail=30 --durations=15; stamp "rc $?") > "$OUT_DIR/cpu_tests.log" 2>&1 &
{
  stamp noise_floor
  timeout 90 python3 benchmarks/noise_floor.py --size gpu --device cuda
  stamp sampler_mismatch
  timeout 200 python3 benchmarks/sampler_mismatch.py --size gpu --device cuda --seeds 1 --rollouts 4
  stamp memory
  timeout 90 python3 benchmarks/memory.py --size gpu --device cuda --dtype bfloat16
  stamp done
} > "$OUT_DIR/side.log" 2>&1 &
wait
# Phase 3: the step breakdown (a share of each step, so it needs the GPU to itself), in the time left.
left=$(( 575 - ($(date +%s) - started) ))
if [ $left -ge 40 ]; then
  (stamp step_breakdown; timeout $left python3 benchmarks/step_breakdown.py --size gpu --device cuda; stamp done) \
    >> "$OUT_DIR/bench.log" 2>&1
fi
stamp "all done" >> "$OUT_DIR/env.txt"
