#!/usr/bin/env bash
# Every benchmark, then the report: bash benchmarks/run.sh [--quick]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/setup-bench.sh" | tail -n 1)
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
cd "$root/benchmarks"
# Rank output is prefixed "[R]<...>:"; the tables are the unprefixed lines.
for b in allreduce small_ops training; do
    python "$b.py" "$@" | grep -v '^\['
done
python report.py
