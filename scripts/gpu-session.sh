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
# pytest-timeout; Perseus itself needs nothing else. Each step has a time limit, so a hang
# costs that step alone. Its logs and results (the staged and host sweeps' JSON and their
# page, the optimizer and kernel benchmarks' JSON and tables) go to $OUT/results/ and,
# after every step, into $OUT/results.tar too (one file to fetch, up to date however far
# the run got). It exits non-zero when a step failed, after running the others.
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
    top=${OUT:-$root/.gpu/out}
    out=$top/results
    site=${TMPDIR:-/tmp}/perseus-gpu-site
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}"
    export PYTHONPATH=$site PYTHONUNBUFFERED=1
    failed=()
    # step NAME LIMIT COMMAND...: runs it for LIMIT seconds at most, with its output in
    # $out/NAME.log; a failure is reported with the log's tail, and the next steps run.
    step() {
        local name=$1 limit=$2
        shift 2
        echo "==> $name (${limit} s at most): $*"
        local start=$SECONDS rc=0
        timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
        if ((rc == 0)); then
            echo "    ok ($((SECONDS - start)) s)"
        else
            echo "    FAILED (exit $rc, $((SECONDS - start)) s); the end of $name.log:"
            tail -n 40 "$out/$name.log"
            failed+=("$name")
        fi
        tar -C "$top" -cf "$top/results.tar" results
    }
    pytest=(python3 -m pytest -v -rfE -p no:cacheprovider --timeout 45)
    step device 20 nvidia-smi
    step check-build 45 python3 -m perseus.runner.launch --check-build
    # Every test of the GPU files (those without the mark check NVRTC and the errors on
    # this machine's libraries), then the gpu-marked tests of the optimizer and AMP files.
    step gpu-tests 150 "${pytest[@]}" tests/python/test_gpu.py tests/python/test_kernels.py
    step gpu-optim-tests 90 "${pytest[@]}" -m gpu tests/python/test_optim.py \
        tests/python/test_amp.py
    # torch.distributed's perseus backend with CUDA tensors (cuda:perseus in a device map).
    step torch-backend-cuda 60 python3 -m perseus.runner.launch -np 2 python3 \
        tests/python/workers/torch_backend.py cuda
    step kernels 50 python3 benchmarks/kernels.py
    cp docs/benchmarks_kernels_cuda.json docs/benchmarks_kernels_cuda.md "$out/" 2>/dev/null || true
    step staged-sweep 70 python3 benchmarks/allreduce_sweep.py --device cuda --ranks 2 \
        --short --strict --json "$out/staged_sweep.json"
    # The same sweep on host tensors: what the staging to and from the GPU costs.
    step host-sweep 60 python3 benchmarks/allreduce_sweep.py --impls hvd gloo --ranks 2 \
        --short --strict --json "$out/host_sweep.json"
    step staged-page 20 python3 benchmarks/allreduce_sweep.py --page \
        "$out/benchmarks_staged_cuda.md" "$out/staged_sweep.json" "$out/host_sweep.json"
    step optimizer 45 python3 benchmarks/optimizer_step.py --device cuda
    cp docs/benchmarks_optimizer_cuda.json docs/benchmarks_optimizer_cuda.md "$out/" \
        2>/dev/null || true
    tar -C "$top" -cf "$top/results.tar" results
    rm -rf "$out"
    if ((${#failed[@]})); then
        echo "gpu-session: failed: ${failed[*]}" >&2
        exit 1
    fi
    echo "gpu-session: every step passed; logs and results in $top/results.tar"
    ;;
*)
    echo "usage: gpu-session.sh build | run" >&2
    exit 2
    ;;
esac
