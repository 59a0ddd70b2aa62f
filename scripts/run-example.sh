#!/usr/bin/env bash
# Sets up the torch virtual environment, then trains examples/pytorch_mnist.py on two
# local ranks: perseusrun -np 2 python examples/pytorch_mnist.py [ARG ...]
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/setup-venv.sh" torch | tail -n 1)
cd "$root"
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
exec perseusrun -np 2 python examples/pytorch_mnist.py "$@"
