#!/usr/bin/env bash
# The tensor-parallel tests N times in a row, each run's outcome and the count of failures:
# every worker rank must leave with its group and exit 0 (issue 36). Run it beside `make test`
# (in another shell) for the load the suite puts on the machine.
#
#   bash benchmarks/tp_exit_loop.sh [N=30] [pytest args...]
#
# Default tests: the tp suite's group, parity and exit tests, and the served tp-2 executor.
set -u
cd "$(dirname "$0")/.."
runs=${1:-30}
shift || true
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(tests/test_tensor_parallel.py tests/test_tp_server.py)
fi
python=${PYTHON:-.venv/bin/python}
failures=0
start=$(date +%s)
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  if out=$(OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$python" -m pytest -q -p no:cacheprovider \
    -m "not long" "${tests[@]}" 2>&1); then
    status=passed
  else
    status=FAILED
    failures=$((failures + 1))
    printf '%s\n' "$out" | tail -n 40
  fi
  echo "run $i/$runs: $status ($(($(date +%s) - t0)) s; $(printf '%s\n' "$out" | tail -n 1))"
done
echo "tp exit loop: $runs runs, $failures failed, $(($(date +%s) - start)) s in all"
[ "$failures" -eq 0 ]
