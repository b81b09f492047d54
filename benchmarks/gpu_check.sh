#!/usr/bin/env bash
# Every GPU claim opsched makes, measured in one prepared run on a machine with a CUDA GPU and no package index:
# installs opsched (pip --no-deps) and the wheels benchmarks/gpu_wheels.sh downloaded ahead, then runs
# benchmarks/gpu_check.py, which writes DIR/gpu_check.json, DIR/gpu_check.md and DIR/gpu_check.log.
#
#   bash benchmarks/gpu_check.sh --out DIR [--wheels WHEELS] [--dry-run] [--budget SECONDS] [--only STEP ...]
#
# --wheels: the folder of gpu_wheels.sh (default .whl); --dry-run: no GPU, the CUDA backend on the test suite's
# stand-in (rehearses the script here). PYTHON names the interpreter (default python3). Exits non-zero only
# when nothing can run: opsched does not import, or the GPU is unusable.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out="" wheels=.whl passed=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --wheels) wheels=$2; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) passed+=("$1"); shift ;;
    esac
done
if [[ -z $out ]]; then
    echo "gpu_check.sh: --out DIR is required (see --help)" >&2
    exit 2
fi
mkdir -p "$out"
site=$(mktemp -d /tmp/opsched-site.XXXXXX)  # nothing installed outside it
echo "[gpu_check] install: opsched and $(ls "$wheels"/*.whl 2>/dev/null | wc -l) wheels from $wheels into $site" >&2
started=$SECONDS
{
    if compgen -G "$wheels/*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
    fi
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" .
} >"$out/install.log" 2>&1
status=$?
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
if ! "$python" -c "import opsched, networkx, tqdm, matplotlib" >>"$out/install.log" 2>&1; then
    echo "[gpu_check] opsched does not import (install status $status); see $out/install.log:" >&2
    tail -5 "$out/install.log" >&2
    exit 4
fi
"$python" -c "import ortools" >>"$out/install.log" 2>&1 || echo "[gpu_check] no OR-Tools: the exact scheduler's tests fail" >&2
echo "[gpu_check] install: status $status in $((SECONDS - started)) s" >&2
"$python" benchmarks/gpu_check.py --out "$out" --install-seconds $((SECONDS - started)) \
    --install-status "$status" "${passed[@]}"
code=$?
rm -rf "$site"
exit $code
