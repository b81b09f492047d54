#!/usr/bin/env bash
# Download, ahead, the wheels benchmarks/gpu_check.sh installs on a GPU machine that reaches no package index:
# OR-Tools (the exact scheduler and the mapping solvers) and those of its dependencies that a machine with a
# CUDA build of PyTorch lacks, as manylinux wheels for CPython 3.12 on x86-64 (--python-version to change it).
#
#   bash benchmarks/gpu_wheels.sh DIR [--python-version 3.12]
#
# DIR is not committed (add it to .git/info/exclude); about 30 MB.
set -euo pipefail
if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: bash benchmarks/gpu_wheels.sh DIR [--python-version X.Y]" >&2
    exit 2
fi
dir=$1
shift
version=3.12
if [[ ${1:-} == --python-version ]]; then version=$2; fi
mkdir -p "$dir"
# The versions pinned together: OR-Tools 9.15 needs protobuf 6.33 (a GPU image's own protobuf may be older);
# absl-py, numpy, pandas and typing-extensions come with any image that has PyTorch and pandas.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$dir" "ortools==9.15.6755" "protobuf==6.33.1" "immutabledict==4.2.1"
ls -l "$dir"
