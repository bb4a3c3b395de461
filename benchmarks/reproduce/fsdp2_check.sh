#!/usr/bin/env bash
# FSDP2 check for one GPU (recipes/accelerate/fsdp2.yaml, one process, bf16), bounded to about 4 minutes
# (timeouts: (a) 150 s, (b) 100 s + 2 x 90 s; the noise-floor rerun only when a resume differs and time is left):
#   bash benchmarks/reproduce/fsdp2_check.sh [OUT_DIR]          # on the GPU machine, from the repo root
# (a) the quickstart, shortened (cold start before the launch, then GSPO under FSDP2): reward first -> last.
# (b) GSPO + routing replay (R2, routing_replay: old), 6 steps saving every 2 (one rollout batch spans 4 steps, so
#     checkpoint-2 is mid-rollout and checkpoint-4 on a boundary); each checkpoint copied into a fresh output_dir and
#     resumed to step 6; the resumed runs' logged values after the resume point and final weights are compared with
#     the uninterrupted run's. If they differ, a second uninterrupted run shows the run-to-run noise on this GPU.
# Every launch has a timeout; logs go to OUT_DIR (qs.log, full.log, resume2.log, resume4.log, full_again.log) and a
# line `== RESULT ...` per check goes to stdout and OUT_DIR/results.txt.
# Without a GPU: `DRY=1 bash benchmarks/reproduce/fsdp2_check.sh /tmp/x` checks every command line (--dry_run);
# `FSDP_CPU=1 bash ...` runs everything on the CPU through tests/scripts/fsdp_cpu.py (a test-only patch of
# accelerate, which has no FSDP on CPU), float32 plus the config's bf16 autocast: minutes, not seconds.
set -u
OUT_DIR=${1:-outputs/fsdp2_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# trl-gspo runs from the checkout, not installed: the launcher, torchrun and its workers inherit this PYTHONPATH.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - started )) s] $*"; }
result() { echo "== RESULT $*" | tee -a "$OUT_DIR/results.txt"; }
: > "$OUT_DIR/results.txt"

if [ "${FSDP_CPU:-0}" = 1 ]; then
  CLI=("$PY" tests/scripts/fsdp_cpu.py cli); HW=(--use_cpu false --bf16 false); SCALE=cpu; SLOW=4
else
  CLI=("$PY" -m trl_gspo.launch.cli); HW=(--use_cpu false --bf16 true); SCALE=gpu; SLOW=1
fi
DRY_ARGS=(); [ "${DRY:-0}" = 1 ] && DRY_ARGS=(--dry_run true)
LAUNCH=(--accelerate_config recipes/accelerate/fsdp2.yaml --num_processes 1)
# run LOG TIMEOUT ARGS...: one trl-gspo launch, its output in LOG; prints the exit code (124: timed out).
run() {
  local log=$1 limit=$2; shift 2
  stamp "${CLI[*]} $*" > "$log"
  timeout -k 10 $((limit * SLOW)) "${CLI[@]}" "$@" "${HW[@]}" "${LAUNCH[@]}" "${DRY_ARGS[@]}" >> "$log" 2>&1
  local rc=$?
  stamp "rc $rc" >> "$log"
  return $rc
}

"$PY" -c "import torch, transformers, trl, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'); print('transformers',
transformers.__version__, 'trl', trl.__version__, 'accelerate', accelerate.__version__)" > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

# (a) The quickstart, shortened: 400 SFT steps (one plain process, before the launch) + 160 GSPO steps under FSDP2.
stamp "(a) quickstart under FSDP2"
if [ $SCALE = gpu ]; then QS=(--sft_steps 400 --max_steps 160 --logging_steps 20); else
  QS=(--sft_steps 50 --max_steps 20 --logging_steps 5); fi
run "$OUT_DIR/qs.log" 150 --config recipes/quickstart.yaml --output_dir "$OUT_DIR/qs" "${QS[@]}"
rc=$?
if [ "${DRY:-0}" = 1 ]; then result "(a) dry run rc $rc: $(grep -m1 'recipe is valid' "$OUT_DIR/qs.log")"
else
  "$PY" - "$OUT_DIR/qs" $rc <<'EOF' 2>&1 | tee -a "$OUT_DIR/results.txt"
import json, sys
out, rc = sys.argv[1], int(sys.argv[2])
try:
    history = json.load(open(f"{out}/trainer_state.json"))["log_history"]
except OSError:
    print(f"== RESULT (a) quickstart FAILED rc {rc}: no trainer_state.json (see qs.log)"); raise SystemExit(1)
rewards = [h["reward"] for h in history if "reward" in h]
speed = [h["train_runtime"] for h in history if "train_runtime" in h]
ok = rc == 0 and len(rewards) >= 2 and rewards[-1] > rewards[0]
print(f"== RESULT (a) quickstart {'OK' if ok else 'CHECK'} rc {rc}: reward first -> last {rewards[0]:.3f} -> "
      f"{rewards[-1]:.3f} over {len(rewards)} logs, GSPO train_runtime {speed[-1] if speed else '?'} s")
EOF
fi
grep -h "fsdp_cpu\]" "$OUT_DIR/qs.log" 2>/dev/null

# (b) GSPO + R2 routing replay with checkpoints every 2 steps, then exact resumes from checkpoint-2 and -4.
cat > "$OUT_DIR/replay.yaml" <<'EOF'
model_name_or_path: builtin:tiny-qwen3-moe
dataset_name: builtin:addition
reward_funcs: [digit_match_reward]
sft_steps: 0
loss_type: gspo
routing_replay: old
learning_rate: 5.0e-4
per_device_train_batch_size: 8
num_generations: 4
steps_per_generation: 4
max_completion_length: 4
max_steps: 6
logging_steps: 1
save_strategy: steps
save_steps: 2
seed: 0
report_to: none
gradient_checkpointing: false
plot: false
EOF
stamp "(b) uninterrupted, 6 steps, save every 2"
run "$OUT_DIR/full.log" 100 --config "$OUT_DIR/replay.yaml" --output_dir "$OUT_DIR/full"
rc_full=$?
compare() {  # compare NAME RC DIR START: logs after step START and final weights of DIR against full/
  "$PY" - "$OUT_DIR/full" "$3" "$4" "$1" "$2" <<'EOF' || true
import json, math, os, sys
ref_dir, dir_, start, name, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
SKIP = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch", "train_loss",
        "total_flos")
def logs(path):
    history = json.load(open(os.path.join(path, "trainer_state.json")))["log_history"]
    return {h["step"]: h for h in history if "loss" in h and h["step"] > start}, history
try:
    ref, _ = logs(ref_dir); got, history = logs(dir_)
except OSError as err:
    print(f"== RESULT (b) {name} FAILED rc {rc}: {err}"); raise SystemExit(0)
worst, worst_key, missing = 0.0, None, sorted(set(ref) ^ set(got))
for step in sorted(set(ref) & set(got)):
    for key, value in ref[step].items():
        if key in SKIP or not isinstance(value, (int, float)) or key not in got[step]:
            continue
        d = abs(got[step][key] - value) if math.isfinite(value) else float(got[step][key] != value)
        if d > worst:
            worst, worst_key = d, f"{key}@{step}"
weights = "?"
try:
    from safetensors.torch import load_file
    a = load_file(os.path.join(ref_dir, "model.safetensors")); b = load_file(os.path.join(dir_, "model.safetensors"))
    weights = max((a[k].float() - b[k].float()).abs().max().item() for k in a) if a.keys() == b.keys() else "keys differ"
except Exception as err:  # noqa: BLE001
    weights = f"unreadable ({type(err).__name__}: {err})"
drift = [h["routing/drift_mean"] for h in history if "routing/drift_mean" in h]
exact = rc == 0 and not missing and worst == 0.0 and weights == 0.0
print(f"== RESULT (b) {name} {'EXACT' if exact else 'DIFFERS'} rc {rc}: steps {sorted(got)} compared, "
      f"max |logged diff| {worst:.3g}{f' ({worst_key})' if worst_key else ''}, steps missing/extra {missing}, "
      f"final weights max |diff| {weights}, routing/drift_mean last {drift[-1] if drift else 'none'}")
EOF
}
if [ "${DRY:-0}" = 1 ]; then result "(b) dry run rc $rc_full: $(grep -m1 'recipe is valid' "$OUT_DIR/full.log")"
else
  ckpts=$(ls -d "$OUT_DIR"/full/checkpoint-* 2>/dev/null | xargs -n1 basename 2>/dev/null | tr '\n' ' ')
  files=$(ls "$OUT_DIR/full/checkpoint-2" 2>/dev/null | tr '\n' ' ')
  result "(b) uninterrupted rc $rc_full: checkpoints [$ckpts], checkpoint-2 holds [$files]"
  any_diff=0
  for step in 2 4; do
    if [ ! -f "$OUT_DIR/full/checkpoint-$step/trainer_state.json" ] || [ ! -f "$OUT_DIR/full/model.safetensors" ]; then
      result "(b) resume from checkpoint-$step SKIPPED: the uninterrupted run left no complete checkpoint-$step or final weights"
      continue
    fi
    stamp "(b) resume from checkpoint-$step in a fresh output_dir"
    rm -rf "$OUT_DIR/resume$step"; mkdir -p "$OUT_DIR/resume$step"
    cp -r "$OUT_DIR/full/checkpoint-$step" "$OUT_DIR/resume$step/" 2>/dev/null
    run "$OUT_DIR/resume$step.log" 90 --config "$OUT_DIR/replay.yaml" --output_dir "$OUT_DIR/resume$step" \
      --resume_from_checkpoint "$OUT_DIR/resume$step/checkpoint-$step"
    line=$(compare "resume from checkpoint-$step" $? "$OUT_DIR/resume$step" $step)
    echo "$line" | tee -a "$OUT_DIR/results.txt"
    case "$line" in *EXACT*) ;; *) any_diff=1;; esac
  done
  left=$(( 330 * SLOW - ($(date +%s) - started) ))
  if [ $any_diff = 1 ] && [ $left -ge 60 ]; then  # the noise floor: does an identical fresh run differ as much?
    stamp "(b) a second uninterrupted run, for the run-to-run noise"
    run "$OUT_DIR/full_again.log" $(( (left < 120 * SLOW ? left : 120 * SLOW) / SLOW )) --config "$OUT_DIR/replay.yaml" \
      --output_dir "$OUT_DIR/full_again"
    compare "second uninterrupted run (noise floor)" $? "$OUT_DIR/full_again" 0 | tee -a "$OUT_DIR/results.txt"
  fi
fi
grep -h "Traceback\|Error\|error:" "$OUT_DIR"/*.log 2>/dev/null | grep -v "Warning" | sort | uniq -c | head -8
stamp "all done (logs and results.txt in $OUT_DIR)"
