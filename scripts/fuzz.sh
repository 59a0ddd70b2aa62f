#!/usr/bin/env bash
# A short fuzz run of every target in fuzz/ (default 10 s each; FUZZ_SECONDS to change).
# Installs cargo-fuzz into the cache once. Needs a nightly compiler for the
# sanitizer flags: the nightly toolchain when rustup has one, else the stable one
# with RUSTC_BOOTSTRAP=1. The seeds are fuzz/corpus/<target>/; inputs that found new
# paths are kept in the cache ($PERSEUS_CACHE/fuzz-corpus/<target>), so later runs go on
# from them without changing the repository.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
cache=${PERSEUS_CACHE:-$HOME/.cache/perseus}
seconds=${FUZZ_SECONDS:-10}
version=0.13.1
tools="$cache/cargo-fuzz-$version"
if [[ ! -x $tools/bin/cargo-fuzz ]]; then
    echo "fuzz.sh: installing cargo-fuzz $version into $tools" >&2
    cargo install --locked --root "$tools" cargo-fuzz --version "$version"
fi
export PATH="$tools/bin:$PATH"
toolchain=()
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    toolchain=(+nightly)
else
    export RUSTC_BOOTSTRAP=1
fi
# The fuzz build has its own target dir in the cache (sanitizer flags differ).
export CARGO_TARGET_DIR="$cache/fuzz-target"
for target in frames messages rendezvous config; do
    echo "==> fuzz $target for ${seconds}s" >&2
    grown="$cache/fuzz-corpus/$target"
    mkdir -p "$grown"
    log="$cache/fuzz-$target.log"
    status=0
    cargo "${toolchain[@]}" fuzz run --fuzz-dir fuzz "$target" "$grown" "fuzz/corpus/$target" -- \
        -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$log" 2>&1 || status=$?
    grep -E "^(#[0-9]+ +(DONE|INITED)|stat::number_of_executed_units)" "$log" >&2 || true
    if [[ $status -ne 0 ]]; then
        tail -n 40 "$log" >&2
        echo "fuzz.sh: $target failed (exit $status); the input is in fuzz/artifacts/$target/" >&2
        exit "$status"
    fi
done
