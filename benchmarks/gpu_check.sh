#!/usr/bin/env bash
# The GPU check, in one go (under 10 minutes on one GPU): profile a small GPT-2 (the built-in)
# and an HF Llama on CUDA, plan each for 2 stages, and check (benchmarks/gpu_check.py) that
#   - the sum of units is within 10% of the whole-model step, at every micro-batch size;
#   - each stage's predicted peak memory is at least torch.cuda.max_memory_allocated when that
#     stage runs alone (its in-flight micro-batches, backward, optimizer step).
# Writes the figures (markdown for docs/benchmarks.md, JSON beside) to $OUT (default ./gpu-check).
#
#   benchmarks/gpu_check.sh                  # on a CUDA machine
#   DEVICE=cpu QUICK=1 benchmarks/gpu_check.sh   # dry run on CPU: same steps, tiny sizes, memory n/a
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
if [ "${QUICK:-0}" = 1 ]; then
  GPT2=(gpt2-tiny --layers 4 --hidden 64 --heads 2 --vocab 256 --seq-len 32 --microbatch-sizes 1,2 --repeats 2 --warmup 1)
  LLAMA=(hf:llama --layers 4 --hidden 64 --heads 2 --vocab 256 --seq-len 32 --microbatch-sizes 1,2 --repeats 2 --warmup 1)
  BATCH=4
else
  GPT2=(gpt2 --layers 6 --seq-len 512 --microbatch-sizes 1,2,4)
  LLAMA=(hf:llama --layers 8 --hidden 1024 --heads 16 --vocab 32000 --seq-len 512 --microbatch-sizes 1,2,4)
  BATCH=16
fi
status=0
{
  echo "## GPU check ($(date -u +%Y-%m-%dT%H:%MZ), device $DEVICE)"
  $PY -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
  echo
} | tee "$OUT/gpu-check.md"
for name in gpt2 llama; do
  if [ $name = gpt2 ]; then args=("${GPT2[@]}"); else args=("${LLAMA[@]}"); fi
  started=$(date +%s)
  if ! $PY -m pipeplan profile "${args[@]}" --device "$DEVICE" -o "$OUT/$name.json" > "$OUT/$name-profile.log" 2>&1; then
    echo "FAILED: profile $name: $(grep -m1 -E 'error|Error' "$OUT/$name-profile.log")" | tee -a "$OUT/gpu-check.md"; status=1; continue
  fi
  if ! $PY -m pipeplan plan "$OUT/$name.json" --stages 2 --global-batch $BATCH --schedule 1f1b -o "$OUT/$name-plan.json" -q; then
    echo "FAILED: plan $name" | tee -a "$OUT/gpu-check.md"; status=1; continue
  fi
  $PY benchmarks/gpu_check.py "$OUT/$name.json" "$OUT/$name-plan.json" --device "$DEVICE" --out "$OUT/$name-check.json" \
    | tee -a "$OUT/gpu-check.md" || status=1
  echo "($name: $(( $(date +%s) - started )) s; load average $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$OUT/gpu-check.md"
  echo | tee -a "$OUT/gpu-check.md"
done
exit $status
