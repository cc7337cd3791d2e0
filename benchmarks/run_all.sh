#!/usr/bin/env bash
# Every measurement in benchmarks/README.md (about 15 minutes on 2 CPU cores). Arguments go to each call,
# e.g. `benchmarks/run_all.sh --accelerator cuda`; PY picks the interpreter, OUT the results folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
"$PY" benchmarks/compare.py --suite cli step --procs 1 2 --steps 100 700 --json "$OUT/step.json" "$@"
"$PY" benchmarks/compare.py --suite logging --procs 1 2 --steps 100 700 --json "$OUT/logging.json" "$@"
"$PY" benchmarks/compare.py --suite ckpt --procs 1 --steps 100 700 --ckpt-every 100 --json "$OUT/ckpt.json" "$@"
"$PY" benchmarks/compare.py --suite compile --procs 1 --steps 100 700 --pairs 3 --json "$OUT/compile.json" "$@"
