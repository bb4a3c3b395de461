# Shared setup of gpu_acceptance.sh and gpu_fsdp2_flagship.sh, sourced from the repository root after the script has
# set OUT_DIR and COMMIT. It creates OUT_DIR, starts the clock of `stamp` (seconds since the start), installs the
# wheels in .whl/ (if any) into /tmp/site and the package in editable mode, exports the common environment, and
# defines `write_env`, which prints the commit, date, GPU, library versions, cores and memory for env.txt.
mkdir -p "$OUT_DIR"
started=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - started )) s] $*"; }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . >/dev/null 2>&1 \
  || echo "editable install failed: the package runs from PYTHONPATH" >&2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

write_env() {
  echo "commit $COMMIT"; date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, trl, accelerate, peft, deepspeed, datasets; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); \
print('transformers', transformers.__version__, 'trl', trl.__version__, 'accelerate', accelerate.__version__, \
'peft', peft.__version__, 'deepspeed', deepspeed.__version__, 'datasets', datasets.__version__)" 2>&1 | grep -v Warn
  nproc; free -g | head -2
}
