#!/usr/bin/env bash
# Usage: scripts/setup-venv.sh FRAMEWORK      (FRAMEWORK: a requirements/FRAMEWORK.txt)
#
# Makes (or reuses) the virtual environment for FRAMEWORK and installs Perseus into it:
#   ${PERSEUS_CACHE:-~/.cache/perseus}/venv-FRAMEWORK-<sha256 of requirements, 12 hex>
# The requirements are installed once (a stamp file marks success); Perseus is rebuilt
# every time with `maturin develop --release` (incremental; cargo's target directory
# ${PERSEUS_CACHE}/target is shared by every clone). The venv path is printed as the
# last line of stdout; everything else goes to stderr. PYTHON picks the base interpreter.
set -euo pipefail

framework=${1:?usage: setup-venv.sh FRAMEWORK (e.g. torch)}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
requirements="$root/requirements/$framework.txt"
if [[ ! -f $requirements ]]; then
    echo "setup-venv: no requirements file $requirements" >&2
    exit 2
fi
cache=${PERSEUS_CACHE:-$HOME/.cache/perseus}
venv=$(bash "$root/scripts/make-venv.sh" "$framework" "$requirements" | tail -n 1)

{
    # One build at a time per venv (several clones may share it).
    exec 9>"$venv.lock"
    flock 9
    echo "setup-venv: building Perseus into $venv" >&2
    cd "$root"
    VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$cache/target" \
        "$venv/bin/python" -m maturin develop --release
} >&2

echo "$venv"
