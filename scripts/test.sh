#!/usr/bin/env bash
# The whole test suite: Rust format, lints and tests, then Python lint and tests in the
# torch virtual environment, then the TensorFlow and the MXNet tests, each in its own
# (all made by scripts/setup-venv.sh).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export PERSEUS_CACHE=${PERSEUS_CACHE:-$HOME/.cache/perseus}
export CARGO_TARGET_DIR="$PERSEUS_CACHE/target"

step() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*" >&2; }

step "cargo fmt --check"
cargo fmt --check
step "cargo clippy (all targets)"
cargo clippy --release --all-targets -- -D warnings
step "cargo test"
cargo test --release
step "cargo test (cuda feature: the GPU path's discovery and kernels, docs/gpu.md)"
cargo test --release --features cuda --lib gpu::
step "fuzz (a short run of each target; docs/reliability.md)"
bash scripts/fuzz.sh

step "torch virtual environment"
python="$(bash scripts/make-venv.sh torch requirements/torch.txt | tail -n 1)/bin/python"

# Before any `maturin develop`: PYO3_PYTHON here makes pyo3's build script run again, and
# after it each develop would too; in this order only the torch one does.
step "cargo clippy (python and cuda features, as the wheel is built)"
PYO3_PYTHON="$python" cargo clippy --release --features python,cuda -- -D warnings

step "Perseus into the torch virtual environment"
venv=$(bash scripts/setup-venv.sh torch | tail -n 1)
# This clone's package first, whatever clone last installed into the shared venv.
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$venv/bin:$PATH"

lint=()
for dir in python tests benchmarks scripts; do
    if [[ -d $dir ]]; then lint+=("$dir"); fi
done
step "ruff check ${lint[*]}"
"$python" -m ruff check "${lint[@]}"

step "Open MPI for the launcher tests"
# tests/python/test_launchers.py runs the same worker under mpirun and perseusrun --mpi.
if ! command -v mpirun >/dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        apt-get update && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends openmpi-bin
    else
        echo "test.sh: no mpirun and cannot install openmpi-bin: the mpirun tests skip" >&2
    fi
fi

# mpi4py for the test of mpirun jobs on several hosts without PERSEUS_MASTER_ADDR (rank 0's
# address then comes through MPI): kept beside the virtual environments, not in them.
mpi4py_dir="$PERSEUS_CACHE/mpi4py-4.1.2"
if command -v mpirun >/dev/null && [[ ! -d $mpi4py_dir/mpi4py ]]; then
    step "mpi4py for the mpirun tests"
    "$python" -m pip install --disable-pip-version-check --quiet --target "$mpi4py_dir.tmp" \
        mpi4py==4.1.2 && mv "$mpi4py_dir.tmp" "$mpi4py_dir" \
        || echo "test.sh: cannot install mpi4py: its mpirun test skips" >&2
    rm -rf "$mpi4py_dir.tmp"
fi
export PERSEUS_TEST_MPI4PY="$mpi4py_dir"

# The release wheel, built before the tests: tests/python/test_packaging.py installs it
# (PERSEUS_TEST_WHEEL) rather than building one of its own, and test_wheel.py reads its
# tags and ELF; the compatibility cells below install it too.
step "the release wheel (scripts/build-wheel.sh)"
dist="$PERSEUS_CACHE/ci-dist"
rm -rf "$dist"
wheel_built=0
if bash scripts/build-wheel.sh --out "$dist"; then
    wheel_built=1
    export PERSEUS_TEST_WHEEL="$dist"
fi

# pytest's status 5 means it collected nothing: a failure here too.
run_pytest() {
    local status=0
    "$@" || status=$?
    if [[ $status -eq 5 ]]; then
        echo "test.sh: pytest collected no tests" >&2
        status=1
    fi
    return "$status"
}

# Every rank of every test imports the package and the tests' helpers: compiled once
# here (after the wheel, which must not hold them), not in each process, where
# PYTHONDONTWRITEBYTECODE may keep Python from writing what it compiled.
"$python" -m compileall -q python tests

step "pytest tests/python"
status=0
[[ $wheel_built -eq 1 ]] || status=1
run_pytest "$python" -m pytest -q --durations=40 tests/python || status=$?

step "TensorFlow virtual environment"
tf_venv=$(bash scripts/setup-venv.sh tensorflow | tail -n 1)
step "pytest tests/tensorflow"
PATH="$tf_venv/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=2 \
    run_pytest "$tf_venv/bin/python" -m pytest -q --durations=10 tests/tensorflow || status=$?

step "MXNet virtual environment"
mx_venv=$(bash scripts/setup-venv.sh mxnet | tail -n 1)
step "pytest tests/mxnet"
PATH="$mx_venv/bin:$PATH" run_pytest "$mx_venv/bin/python" -m pytest -q tests/mxnet || status=$?

# The compatibility matrix's extremes (docs/compatibility.md): the oldest and the newest
# torch and TensorFlow, between them on the oldest and the newest Python, each in its own
# environment with the release wheel installed as a user would.
if [[ $wheel_built -eq 1 ]]; then
    step "compatibility matrix: the extremes"
    wheel=$(ls "$dist"/perseus-*.whl)
    bash scripts/compat-matrix.sh --wheel "$wheel" torch-2.1 torch-2.15-py3.13 \
        tf-2.16-py3.9 tf-2.21-py3.13 || status=$?
fi
exit "$status"
