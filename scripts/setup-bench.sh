#!/usr/bin/env bash
# Usage: scripts/setup-bench.sh
# The benchmark environment: Debian's OpenMPI (for mpirun and mpi4py), the torch virtual
# environment (scripts/setup-venv.sh torch) and requirements/bench.txt installed into it.
# Prints the venv path as its last line.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! command -v mpirun >/dev/null; then
    echo "setup-bench: installing openmpi-bin" >&2
    apt-get update >&2 && apt-get install -y --no-install-recommends openmpi-bin >&2
fi
venv=$(bash "$root/scripts/setup-venv.sh" torch | tail -n 1)
stamp="$venv/.perseus-bench-$(sha256sum "$root/requirements/bench.txt" | cut -c1-12)"
if [[ ! -f $stamp ]]; then
    "$venv/bin/python" -m pip install --disable-pip-version-check -r "$root/requirements/bench.txt" >&2
    touch "$stamp"
fi
echo "$venv"
