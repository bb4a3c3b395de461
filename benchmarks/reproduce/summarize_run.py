"""Print a finished run's logged metrics: for each key named, every logged value and first -> last.

    python benchmarks/reproduce/summarize_run.py OUTPUT_DIR reward tools/call_frequency ...

Reads OUTPUT_DIR/trainer_state.json (written by the Trainer at the end of training)."""

import json
import sys
from pathlib import Path

folder, *keys = sys.argv[1:]
state_file = Path(folder) / "trainer_state.json"
if not state_file.is_file():
    sys.exit(f"{state_file}: no trainer_state.json (the run did not finish)")
history = json.loads(state_file.read_text())["log_history"]
print(f"{folder}: global_step {history[-1].get('step')}, train_runtime {history[-1].get('train_runtime')} s")
for key in keys:
    values = [(h["step"], h[key]) for h in history if key in h]
    if not values:
        print(f"{key}: not logged")
        continue
    print(f"{key}: first -> last {values[0][1]:.4g} -> {values[-1][1]:.4g} (steps {values[0][0]} -> {values[-1][0]}); "
          + ", ".join(f"{step}: {value:.4g}" for step, value in values))
