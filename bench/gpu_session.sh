#!/usr/bin/env bash
# Issue 12's GPU half in one command, for a session lent an H100 (a few minutes of its 15).
#
#   bench/gpu_wheels.sh                                   # here first: OR-Tools as wheels
#   run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# On the device machine (torch, onnx, onnxruntime in its python3; see
# /work/.library/device/KINDS.md) it installs the carried wheels, then:
#  1. `autoshard calibrate --torch --ranks 0`: bf16 matmul curve, the float32 vector rate, HBM
#     bandwidth, the launch floor and the special functions' rates of this GPU, with CUDA
#     events (links are not measured: nccl needs two GPUs, the machine has one);
#  2. bench/fidelity_models.py: shape-only Llama-2-7B-, GPT-2-XL- and BERT-large-wide models of
#     2 layers;
#  3. bench/cost_fidelity.py with the torch probe on CUDA (bf16, CUDA events, the median of
#     several runs), one device (mesh 1), at batch x seq 1x512, 8x2048 and 4x1024, against the
#     dgx-h100 preset and against the calibration of step 1.
# Under $OUT (what comes back): session.log (everything printed), cluster_h100.json, and
# fidelity_<batch>x<seq>_<cluster>.json (rows per class and every op's times). CLUSTERS=dgx-h100
# prices against the preset only (half the time: the times are the same, and any cluster can
# price them again later: bench/data/h100 keeps a run's, `bench/cost_fidelity.py --measured`).
# The issue's targets: the whole forward within ±20 % of the measured sum, each class ±25 %.
# A smoke test without a GPU: DEVICE=cpu SIZES=1x16 LAYERS=1 OUT=/tmp/x bench/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/autoshard-gpu} DEVICE=${DEVICE:-cuda} SIZES=${SIZES:-1x512 8x2048 4x1024}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ! python3 -c "import ortools" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "no OR-Tools: run bench/gpu_wheels.sh first"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, onnxruntime, ortools; print('torch', torch.__version__, 'cuda', \
  torch.cuda.is_available(), 'onnxruntime', onnxruntime.__version__, 'ortools', ortools.__version__)"
started=$SECONDS

timeout 150 python3 -m autoshard calibrate --torch --ranks 0 -o "$OUT/cluster_h100.json" \
  || echo "calibrate failed: the tables below use the preset only"
timeout 60 python3 bench/kernel_access.py --device "$DEVICE" || echo "kernel_access failed"
models_dir=$(mktemp -d)
python3 bench/fidelity_models.py "$models_dir" --layers "${LAYERS:-2}"
models=("$models_dir"/llama.onnx "$models_dir"/gpt.onnx "$models_dir"/bert.onnx)
for size in $SIZES; do
  for cluster in ${CLUSTERS:-dgx-h100 "$OUT/cluster_h100.json"}; do
    [ -f "$cluster" ] || [ "$cluster" = dgx-h100 ] || continue
    name=$(basename "$cluster" .json)
    echo "== fidelity at ${size}, estimates on ${name} ($((SECONDS - started)) s so far)"
    timeout 100 python3 bench/cost_fidelity.py --probe torch --device "$DEVICE" --mesh 1 \
      --cluster "$cluster" --models "${models[@]}" --dim "batch=${size%x*}" \
      --dim "seq=${size#*x}" --worst 4 --json "$OUT/fidelity_${size}_${name}.json" \
      || echo "fidelity at ${size} on ${name} failed or timed out"
  done
done
echo "done in $((SECONDS - started)) s"
