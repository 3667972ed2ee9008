#!/usr/bin/env bash
# The GPU check: every CUDA path of the executor on the GPU at hand, in one command, offline.
#
#   bash benchmarks/device_check.sh            # on a CUDA machine (make gpu-check)
#   bash benchmarks/device_check.sh --dry-run  # the same plumbing on the CPU, tiny models
#   bash benchmarks/device_check.sh --stages paths,latency   # some stages only
#
# It uses this machine's python3 (PYTHON overrides) and its torch/triton, and installs the
# wheels of .whl/ (`make device-wheels`), if any, into a temporary folder with pip
# --no-index: no network, no venv. Stages run in priority order, each in its own process
# under its own time cap, all within DEVICE_CHECK_DEADLINE_S (470 s; a stage that no longer
# fits is skipped). After each stage one line goes to $OUT/summary.md (stage, PASS/FAIL/SKIP,
# seconds, key figures), so a run cut off still leaves what it measured; the log is
# $OUT/check.log, each stage's details $OUT/details.jsonl, the tests' JUnit XML beside them.
# With OUT unset it writes to a new temporary folder. The summary table is printed last.
# Exit status: 0 when no stage failed. docs/gpu.md has the runs so far.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DEADLINE=${DEVICE_CHECK_DEADLINE_S:-470}
T0=$(date +%s)
DRY=()
ONLY=""
while (($#)); do
  case $1 in
    --dry-run) DRY=(--dry-run) ;;
    --stages) ONLY=",$2,"; shift ;;
    *) echo "usage: $0 [--dry-run] [--stages a,b]" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z ${OUT:-} ]]; then
  OUT=$(mktemp -d -t device-check.XXXXXX)
fi
mkdir -p "$OUT"
SCRATCH=$(mktemp -d -t device-check-scratch.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
exec > >(tee -a "$OUT/check.log") 2>&1
# PYTHONFAULTHANDLER: a stage that aborts (a C++ assert) prints its Python stack.
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONFAULTHANDLER=1
# Fresh compiler caches for this run, shared by its stages (each compiles once).
export TRITON_CACHE_DIR=$SCRATCH/triton TORCHINDUCTOR_CACHE_DIR=$SCRATCH/inductor
CACHE=$SCRATCH/executor-cache
SUMMARY=$OUT/summary.md
FAILED=0

{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')${DRY:+ (dry run on the CPU)}"
  echo
  echo "| stage | result | seconds | key figures |"
  echo "|---|---|---:|---|"
} >"$SUMMARY"

record() { # stage result seconds figures
  echo "| $1 | $2 | $3 | $4 |" >>"$SUMMARY"
  [[ $2 == FAIL ]] && FAILED=1
  echo ">>> $1: $2 ($3 s) $4"
}

finish() {
  echo
  echo "results in $OUT"
  echo
  cat "$SUMMARY"
  exit "$FAILED"
}

# stage NAME CAP_S: run it unless the deadline is too close; cap it to what is left.
stage() {
  local name=$1 cap=$2
  if [[ -n $ONLY && $ONLY != *",$name,"* && $name != preflight ]]; then
    return 0
  fi
  local left=$((DEADLINE - ($(date +%s) - T0)))
  if ((left < 15)); then
    record "$name" SKIP 0 "deadline: ${left} s left of ${DEADLINE} s"
    return 0
  fi
  ((cap > left)) && cap=$left
  echo
  echo "=== $name (cap ${cap} s, $((left)) s left)"
  : >"$SCRATCH/figures"
  local start=$EPOCHREALTIME
  DEVICE_CHECK_STAGE_S=$cap timeout --kill-after=5 "$cap" \
    "$PY" benchmarks/device_check.py "$name" "${DRY[@]}" --out "$OUT" \
    --figures "$SCRATCH/figures" --cache-dir "$CACHE"
  local rc=$?
  local secs
  secs=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
  local figures
  figures=$(cat "$SCRATCH/figures" 2>/dev/null)
  case $rc in
    0) record "$name" PASS "$secs" "$figures" ;;
    3) record "$name" SKIP "$secs" "$figures" ;;
    124 | 137) record "$name" FAIL "$secs" "timed out after ${cap} s${figures:+; $figures}" ;;
    *) record "$name" FAIL "$secs" "${figures:-exit $rc: see check.log}" ;;
  esac
  return 0
}

echo "GPU check: python $($PY -c 'import sys; print(sys.version.split()[0])'), out $OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
# The wheels the image lacks (make device-wheels), beside this python's own packages.
SITE=$SCRATCH/site
WHEEL_DIR=${DEVICE_CHECK_WHEELS:-.whl} # the suite's dry run points it elsewhere
WHEELS=("$WHEEL_DIR"/*.whl)
if [[ -e ${WHEELS[0]} ]]; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$SITE" "${WHEELS[@]}"; then
    record preflight FAIL 0 "pip could not install the ${#WHEELS[@]} wheels of .whl/ (make device-wheels DEVICE_PYTHON=<this python>)"
    finish
  fi
  echo "installed ${#WHEELS[@]} wheels from $WHEEL_DIR/ into $SITE"
else
  SITE=""
  echo "no wheels in $WHEEL_DIR/: using this python's own packages"
fi
export PYTHONPATH=${SITE:+$SITE:}$ROOT:$ROOT/proto${PYTHONPATH:+:$PYTHONPATH}

# Priority order: what only a GPU proves first; caps in seconds.
stage preflight 60
if grep -q '^| preflight | FAIL' "$SUMMARY"; then
  finish # fails fast: the rest would fail the same way
fi
stage gpu_tests 150
stage paths 130
stage attention 45
stage latency 45
stage occupancy 90
stage kernels 40
stage graph_memory 90
stage nccl 20
stage memory_release 60
stage host_phases 60
finish
