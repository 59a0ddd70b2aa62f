#!/usr/bin/env bash
# Usage: scripts/setup-bench.sh
# The benchmark environment: Debian's Open MPI (mpirun for the mpi4py peer, and its headers
# in case mpi4py has to be built from source), then the virtual environment of
# requirements/bench.txt (the torch requirements, mpi4py, matplotlib) with Perseus built
# into it by scripts/setup-venv.sh, and MPICH (requirements/bench-mpich.txt) in the venv's
# mpich/ folder, apart from Open MPI's mpi4py. Prints the venv path as the last line of
# stdout; everything else goes to stderr.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! command -v mpirun >/dev/null; then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "setup-bench: no mpirun, and apt-get as root is not available to install" \
            "openmpi-bin: install Open MPI and run again" >&2
        exit 1
    fi
    echo "setup-bench: installing openmpi-bin and libopenmpi-dev" >&2
    {
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            openmpi-bin libopenmpi-dev
    } >&2
fi
venv=$(bash "$root/scripts/setup-venv.sh" bench | tail -n 1)
mpich_req="$root/requirements/bench-mpich.txt"
stamp="$venv/mpich/.requirements"
if ! cmp -s "$mpich_req" "$stamp" 2>/dev/null; then
    echo "setup-bench: installing MPICH into $venv/mpich" >&2
    rm -rf "$venv/mpich"
    "$venv/bin/python" -m pip install --quiet --no-deps --target "$venv/mpich" \
        -r "$mpich_req" >&2
    cp "$mpich_req" "$stamp"
fi
# DeepSpeed builds its shared-memory op at first use; build it here, once, so that no timed
# job compiles it (and none compiles it beside busy processes).
PATH="$venv/bin:$PATH" "$venv/bin/python" -c \
    "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None" >&2
echo "$venv"
