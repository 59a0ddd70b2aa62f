#!/usr/bin/env bash
# Every GPU check of docs/gpu.md in one command, for a machine with a GPU, PyTorch and no
# package registry (such as the device machines some development sessions are lent).
#
#   bash scripts/gpu-session.sh build   # here: the release wheel (with the cuda feature)
#                                       # into .gpu/wheel/ (git ignores .gpu/)
#   bash scripts/gpu-session.sh run     # there, in a copy of the repository that has
#                                       # .gpu/wheel/: installs the wheel, runs the GPU
#                                       # tests and benchmarks, and writes their logs and
#                                       # results to $OUT (default .gpu/out/)
#
# `run` uses the machine's own python3, which must have torch, numpy, pytest and
# pytest-timeout; Perseus itself needs nothing else. It writes 11 files at most: one log
# per step, the staged sweep's JSON, and the optimizer and kernel benchmarks' JSON and
# tables. It exits non-zero when a step failed, after running the others.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

case "${1:-}" in
build)
    venv=$(bash scripts/setup-venv.sh torch | tail -n 1)
    rm -rf .gpu/wheel
    mkdir -p .gpu/wheel
    # `linux`, not manylinux: the wheel goes to one known machine, not to an index.
    CARGO_TARGET_DIR="${PERSEUS_CACHE:-$HOME/.cache/perseus}/target" \
        "$venv/bin/python" -m maturin build --release --compatibility linux \
        --out .gpu/wheel >&2
    ls -l .gpu/wheel
    ;;
run)
    wheels=(.gpu/wheel/*.whl)
    if [[ ! -f ${wheels[0]} ]]; then
        echo "gpu-session: no wheel in .gpu/wheel/; run 'gpu-session.sh build' first" >&2
        exit 2
    fi
    out=${OUT:-$root/.gpu/out}
    site=${TMPDIR:-/tmp}/perseus-gpu-site
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}"
    export PYTHONPATH=$site PYTHONUNBUFFERED=1
    failed=()
    # step NAME COMMAND...: runs it with its output in $out/NAME.log; a failure is
    # reported with the log's tail, and the next steps still run.
    step() {
        local name=$1
        shift
        echo "==> $name: $*"
        local start=$SECONDS
        if "$@" >"$out/$name.log" 2>&1; then
            echo "    ok ($((SECONDS - start)) s)"
        else
            echo "    FAILED (exit $?, $((SECONDS - start)) s); the end of $name.log:"
            tail -n 40 "$out/$name.log"
            failed+=("$name")
        fi
    }
    step device nvidia-smi
    step check-build python3 -m perseus.runner.launch --check-build
    step gpu-tests python3 -m pytest -m gpu -v -p no:cacheprovider \
        tests/python/test_gpu.py tests/python/test_kernels.py tests/python/test_optim.py \
        tests/python/test_amp.py
    step optimizer python3 benchmarks/optimizer_step.py --device cuda
    cp docs/benchmarks_optimizer_cuda.json docs/benchmarks_optimizer_cuda.md "$out/" \
        2>/dev/null || true
    step kernels python3 benchmarks/kernels.py
    cp docs/benchmarks_kernels_cuda.json docs/benchmarks_kernels_cuda.md "$out/" 2>/dev/null || true
    step staged-sweep python3 benchmarks/allreduce_sweep.py --device cuda --ranks 2 --short \
        --strict --json "$out/staged_sweep.json"
    if ((${#failed[@]})); then
        echo "gpu-session: failed: ${failed[*]}" >&2
        exit 1
    fi
    echo "gpu-session: every step passed; logs and results in $out"
    ;;
*)
    echo "usage: gpu-session.sh build | run" >&2
    exit 2
    ;;
esac
