#!/usr/bin/env bash
# The H200 run of 2026-11-26 (docs/results.md) as one bounded command, for a bare one-GPU machine with a short
# time limit (H200: 139 GiB):
#   (on a CPU machine first: the wheels the GPU image lacks, and math-verify's, into .whl/, as
#    gpu_acceptance.sh says)
#   bash benchmarks/reproduce/gpu_fsdp2_flagship.sh [OUT_DIR] [COMMIT]     # on the GPU machine, from the repo root
# Phase 1 has the GPU to itself (the timed ratios). Phase 2 runs four chains side by side, each step with its own
# timeout, so the whole run ends within about 500 s; the untimed figures (peak memory per process, route agreement,
# rewards) do not depend on the neighbours. The flagship-size step (about 61 GB of weights) shares the GPU with
# models of at most 40 GB. Logs, written as they go: env.txt, bench.log, fsdp2.log, gpu_tests.log, tools.log,
# flagship.log.
set -u
OUT_DIR=${1:-outputs/gpu_fsdp2_flagship}
COMMIT=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# shellcheck source=benchmarks/reproduce/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"
export TRL_EXPERIMENTAL_SILENCE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
{
  write_env
  stamp "setup done"
} > "$OUT_DIR/env.txt" 2>&1

# Phase 1: the GPU to itself (one H200, 2026-11-26, commit b9a3f99: 1.012 and 0.999; docs/results.md).
{
  stamp routing_replay_overhead
  timeout 60 python3 benchmarks/routing_replay_overhead.py --size gpu --repeats 41
  stamp loss_overhead
  timeout 60 python3 benchmarks/loss_overhead.py --size gpu --device cuda --repeats 41
  stamp done
} > "$OUT_DIR/bench.log" 2>&1

# Phase 2: four chains side by side, two CPU threads each (16 cores).
export OMP_NUM_THREADS=2
{  # FSDP2 with one process (recipes/accelerate/fsdp2.yaml): the quickstart, GSPO + R2 with checkpoints and resumes
  stamp "FSDP2 checks"
  timeout 330 bash benchmarks/reproduce/fsdp2_check.sh /tmp/fsdp2_work; stamp "fsdp2 rc $?"
  cat /tmp/fsdp2_work/results.txt
  for f in /tmp/fsdp2_work/*.log; do echo "---- $f"; tail -n 25 "$f"; done
} > "$OUT_DIR/fsdp2.log" 2>&1 &
{  # the acceptance suite, then the sampler gap: bf16 HF generate against an fp32 trainer (the last run's figure)
   # and against a bf16 trainer (decode vs prefill alone)
  stamp "pytest -m gpu"
  timeout 170 python3 -m pytest -m gpu -n 3 -p no:cacheprovider -q --durations=0 tests/test_gpu.py
  stamp "pytest rc $?"
  for dtype in float32 bfloat16; do
    stamp "sampler_mismatch, trainer $dtype"
    timeout 130 python3 benchmarks/sampler_mismatch.py --size gpu --device cuda --seeds 1 --rollouts 4 \
      --trainer-dtype $dtype --routing-only
    stamp "rc $?"
  done
} > "$OUT_DIR/gpu_tests.log" 2>&1 &
{  # the tool quickstart on CUDA with R3 across turns: 200 of the recipe's 600 RL steps, to bound the time
  stamp "tool quickstart on CUDA"
  timeout 380 python3 -m trl_gspo.launch.cli --config recipes/quickstart_tools.yaml --use_cpu false --bf16 true \
    --max_steps 200 --logging_steps 20 --output_dir /tmp/quickstart_tools
  stamp "rc $?"
  python3 benchmarks/reproduce/summarize_run.py /tmp/quickstart_tools reward tools/call_frequency \
    routing/sampler_agreement step_time
  stamp done
} > "$OUT_DIR/tools.log" 2>&1 &
{  # the flagship's real size, then the memory benchmark
  stamp "flagship step"
  timeout 200 python3 benchmarks/flagship_step.py --device cuda; stamp "rc $?"
  stamp "memory"
  timeout 170 python3 benchmarks/memory.py --size gpu --device cuda --dtype bfloat16 --replay --budget 100
  stamp "rc $?"
} > "$OUT_DIR/flagship.log" 2>&1 &
wait
stamp "all done" >> "$OUT_DIR/env.txt"
