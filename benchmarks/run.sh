#!/usr/bin/env bash
# Every benchmark, then the report: bash benchmarks/run.sh [--quick] [--only PART ...]
# Sets up the benchmark environment (scripts/setup-bench.sh), then runs run_all.py, which
# writes docs/benchmarks.json, docs/benchmarks.md and docs/benchmarks_allreduce.png
# (--quick: benchmarks/results/quick/ instead).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/setup-bench.sh" | tail -n 1)
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
cd "$root/benchmarks"
exec python run_all.py "$@"
