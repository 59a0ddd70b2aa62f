#!/usr/bin/env bash
# Usage: scripts/make-venv.sh NAME REQUIREMENTS
#
# Makes (or reuses) the virtual environment
#   ${PERSEUS_CACHE:-~/.cache/perseus}/venv-NAME-<sha256 of REQUIREMENTS, 12 hex>
# and installs REQUIREMENTS into it once (a stamp file marks success). One setup at a time
# per venv: several clones may share it. The venv's path is printed as the last line of
# stdout; everything else goes to stderr. PYTHON picks the base interpreter. Used by
# scripts/setup-venv.sh (the test and run environments) and scripts/build-wheel.sh.
set -euo pipefail

name=${1:?usage: make-venv.sh NAME REQUIREMENTS}
requirements=${2:?usage: make-venv.sh NAME REQUIREMENTS}
if [[ ! -f $requirements ]]; then
    echo "make-venv: no requirements file $requirements" >&2
    exit 2
fi
cache=${PERSEUS_CACHE:-$HOME/.cache/perseus}
venv="$cache/venv-$name-$(sha256sum "$requirements" | cut -c1-12)"
stamp="$venv/.perseus-requirements-installed"
mkdir -p "$cache"

{
    exec 9>"$venv.lock"
    flock 9
    if [[ ! -x $venv/bin/python ]]; then
        echo "make-venv: creating $venv" >&2
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    if [[ ! -f $stamp ]]; then
        echo "make-venv: installing $requirements" >&2
        "$venv/bin/python" -m pip install --disable-pip-version-check -r "$requirements"
        cp "$requirements" "$stamp"
    fi
} >&2

echo "$venv"
