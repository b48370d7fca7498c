#!/usr/bin/env bash
# The wheels bench/gpu_session.sh installs on the GPU machine, downloaded here (run it on the
# machine that calls the device tool, in the checkout that is sent). The device machine's image
# has torch, onnx, onnxruntime, numpy, networkx and pyyaml but not OR-Tools (the planner's
# CP-SAT), and it reaches no package registry: OR-Tools travels as wheels in .whl/ (ignored by
# git, named in the run's `carry`), with the protobuf it pins and immutabledict.
#
#   bench/gpu_wheels.sh          # then: run(command="bash bench/gpu_session.sh", carry=[".whl"])
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  ortools==9.15.6755 immutabledict==4.3.1 protobuf==6.33.6
ls -la .whl
