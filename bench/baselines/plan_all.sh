#!/usr/bin/env bash
# Plan the CI set of (model, mesh, options) into OUT/<name>.json (`autoshard plan -o`).
#
#   bench/baselines/plan_all.sh OUT        plan everything (about 30 s on 2 cores)
#   bench/baselines/plan_all.sh bench/baselines     refresh the committed baselines
#
# .ci/run plans into a temporary folder and runs `autoshard report` against the committed
# bench/baselines/*.json: a cost that grows by more than 2% fails CI. Refresh the baselines in
# the same commit as a change that moves costs on purpose, and say why in its message.
# The costs are deterministic (fixed solver seed, deterministic time limit); solve times are
# not, and the report never gates on them.
set -euo pipefail
out=${1:?usage: $0 OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$out"

plan() {  # NAME MODEL ARGS...
  local name=$1 model=$2
  shift 2
  autoshard plan "models/$model.onnx" "$@" -o "$out/$name.json" > /dev/null
  echo "planned $name"
}

plan mlp-2x2-100KB     mlp --mesh 2x2 --dim batch=8 --memory 100KB
plan mlp-4x8           mlp --mesh 4x8 --dim batch=8
plan cnn-2x2           cnn --mesh 2x2 --dim batch=8
plan gpt2-2x4-1MiB     gpt2 --mesh 2x4 --dim batch=8 --dim seq=128 --memory 1MiB
plan gpt2-4x8          gpt2 --mesh 4x8 --dim batch=8 --dim seq=128
plan gpt2_dynamo-4x8   gpt2_dynamo --mesh 4x8 --dim batch=8 --dim seq=128
plan bert-2x4-900KB    bert --mesh 2x4 --dim batch=8 --dim seq=128 --memory 900KB
plan decoder_32l-4x8   decoder_32l_shape_only --mesh 4x8 --dim batch=8 --dim seq=2048
plan gpt2-2x4-training gpt2 --mesh 2x4 --dim batch=8 --dim seq=128 --mode training
plan decoder_32l-4x8-training decoder_32l_shape_only --mesh 4x8 --dim batch=32 --dim seq=2048 --mode training
