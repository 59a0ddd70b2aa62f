#!/usr/bin/env bash
# Usage: scripts/compat-matrix.sh [--wheel PATH] [--doc] [--list] [CELL...]
#
# The compatibility matrix (docs/compatibility.md): builds the wheel once
# (scripts/build-wheel.sh), then, for each cell, a virtual environment of that cell's
# Python with the cell's framework release from the registry and the wheel, in which
# `perseusrun -np 2` runs scripts/compat/job_<framework>.py: collectives' values, a short
# data-parallel training run equal to one process on the whole batch, the broadcast of
# parameters and, for torch, DDP after `import perseus`.
#
#   CELL...      the cells to run (default: all; --list names them)
#   --wheel P    test this wheel instead of building one
#   --doc        write the results into docs/compatibility.md's table (the default when
#                every cell runs; with CELL... only their rows change)
#   --list       print the cells and exit
#
# Each cell's environment is kept in ${PERSEUS_CACHE:-~/.cache/perseus}/compat/, keyed by
# the cell's line below (its requirements are installed once); the wheel is reinstalled
# every run. A cell's Python is python3.X on PATH, else pyenv's newest 3.X. Exit status:
# 0 when every cell run passed, 1 otherwise. Each cell's output is in
# ${PERSEUS_CACHE}/compat/<cell>.log.
set -euo pipefail

# The cells: name, Python, environment variables ("-" for none), then the requirements.
# The oldest and the newest supported release of each framework are here
# (python/perseus/support.py holds the range the front-ends check at import).
CELLS=(
    "torch-2.1          3.11 -                     torch==2.1.2 numpy<2"
    "torch-2.4          3.11 -                     torch==2.4.1 numpy<2"
    "torch-2.8          3.11 -                     torch==2.8.0 numpy"
    "torch-2.11         3.11 -                     torch==2.11.0 numpy"
    "torch-2.15         3.11 -                     torch==2.15.0 numpy"
    "torch-2.8-py3.9    3.9  -                     torch==2.8.0 numpy"
    "torch-2.15-py3.13  3.13 -                     torch==2.15.0 numpy"
    "tf-2.16-keras3     3.11 -                     tensorflow-cpu==2.16.2"
    "tf-2.16-tf-keras   3.11 TF_USE_LEGACY_KERAS=1 tensorflow-cpu==2.16.2 tf-keras==2.16.0"
    "tf-2.18-keras3     3.11 -                     tensorflow-cpu==2.18.1"
    "tf-2.18-tf-keras   3.11 TF_USE_LEGACY_KERAS=1 tensorflow-cpu==2.18.1 tf-keras==2.18.0"
    "tf-2.20-keras3     3.11 -                     tensorflow-cpu==2.20.0"
    "tf-2.20-tf-keras   3.11 TF_USE_LEGACY_KERAS=1 tensorflow-cpu==2.20.0 tf-keras==2.20.1"
    "tf-2.21-keras3     3.11 -                     tensorflow-cpu==2.21.0"
    "tf-2.21-tf-keras   3.11 TF_USE_LEGACY_KERAS=1 tensorflow-cpu==2.21.0 tf-keras==2.21.0"
    "tf-2.16-py3.9      3.9  -                     tensorflow-cpu==2.16.2"
    "tf-2.21-py3.13     3.13 -                     tensorflow-cpu==2.21.0"
    "mxnet-1.9.1        3.11 -                     mxnet==1.9.1 numpy<1.24"
)

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "compat-matrix: $*" >&2; exit 2; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PERSEUS_CACHE:-$HOME/.cache/perseus}
wheel="" doc=0 list=0 wanted=()
while (($#)); do
    case $1 in
        --wheel) wheel=${2:?--wheel needs a path}; shift 2 ;;
        --wheel=*) wheel=${1#*=}; shift ;;
        --doc) doc=1; shift ;;
        --list) list=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) usage >&2; die "unknown option: $1" ;;
        *) wanted+=("$1"); shift ;;
    esac
done

declare -A line_of=()
names=()
for line in "${CELLS[@]}"; do
    read -r name _ <<<"$line"
    line_of[$name]=$line
    names+=("$name")
done
if ((list)); then
    printf '%s\n' "${CELLS[@]}" | sed 's/  */ /g'
    exit 0
fi
if ((${#wanted[@]} == 0)); then
    wanted=("${names[@]}")
    doc=1
fi
for name in "${wanted[@]}"; do
    [[ -n ${line_of[$name]:-} ]] || die "no cell $name (--list names them)"
done

# python3.X on PATH that runs (a pyenv shim may not), else pyenv's newest 3.X.
find_python() {
    local minor=$1 candidate
    local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
    for candidate in "$(command -v "python$minor" 2>/dev/null)" \
        "$(ls -d "$pyenv_root"/versions/"$minor".*/bin/"python$minor" 2>/dev/null |
           sort -V | tail -n 1)"; do
        if [[ -n $candidate ]] && "$candidate" -c 'import venv' >/dev/null 2>&1; then
            echo "$candidate"
            return
        fi
    done
    return 1
}

if [[ -z $wheel ]]; then
    out="$cache/compat/dist"
    rm -rf "$out"
    wheel=$(bash "$root/scripts/build-wheel.sh" --out "$out" | sed -n 's/^wheel: //p')
fi
[[ -f $wheel ]] || die "no wheel at $wheel"
echo "compat-matrix: wheel $(basename "$wheel")" >&2

mkdir -p "$cache/compat"
results=()
failed=0
for name in "${wanted[@]}"; do
    read -r _ minor envs requirements <<<"${line_of[$name]}"
    log="$cache/compat/$name.log"
    start=$SECONDS
    status=passed versions="" why=""
    if ! python=$(find_python "$minor"); then
        status=failed why="no Python $minor on PATH or in pyenv"
    else
        # The venv's key: the cell's line and the base interpreter's version.
        key=$( { echo "${line_of[$name]}"; "$python" -VV; } | sha256sum | cut -c1-12)
        venv="$cache/compat/venv-$name-$key"
        echo "compat-matrix: $name: Python $minor, $requirements$([[ $envs == - ]] ||
            echo " with $envs")" >&2
        {
            set +e
            (
                set -e
                exec 9>"$venv.lock"
                flock 9
                if [[ ! -f $venv/.requirements-installed ]]; then
                    rm -rf "$venv"
                    "$python" -m venv "$venv"
                    "$venv/bin/python" -m pip install --disable-pip-version-check -q \
                        --upgrade pip
                    # shellcheck disable=SC2086 # the requirements are words
                    "$venv/bin/python" -m pip install --disable-pip-version-check -q \
                        $requirements
                    touch "$venv/.requirements-installed"
                fi
                "$venv/bin/python" -m pip install --disable-pip-version-check -q \
                    --force-reinstall --no-deps "$wheel"
                # Out of the repository, so that only the installed wheel is imported.
                work=$(mktemp -d)
                trap 'rm -rf "$work"' EXIT
                cp "$root/scripts/compat/"*.py "$work"/
                cd "$work"
                job=$(case $name in torch*) echo torch ;; tf*) echo tensorflow ;;
                      mxnet*) echo mxnet ;; esac)
                [[ $envs == - ]] || export "${envs?}"
                "$venv/bin/perseusrun" --check-build
                timeout 600 "$venv/bin/perseusrun" -np 2 "$venv/bin/python" "job_$job.py"
            )
            code=$?
            set -e
        } >"$log" 2>&1
        # perseusrun prefixes each rank's lines with [RANK]<stdout>:
        if ((code != 0)); then
            status=failed why="exit $code"
        elif [[ $(grep -c '<stdout>:compat ok: ' "$log") -ne 2 ]]; then
            status=failed why="not every rank reported success"
        fi
        versions=$(grep -m1 '<stdout>:compat ok: rank 0 ' "$log" | sed 's/^.*compat ok: rank 0 of 2, //')
        [[ -n $versions ]] || versions=$requirements
    fi
    seconds=$((SECONDS - start))
    [[ $status == passed ]] || failed=1
    echo "compat-matrix: $name: $status in ${seconds}s${why:+ ($why; see $log)}" >&2
    results+=("$name	$versions	$status${why:+: $why}	$seconds	$(date -u +%Y-%m-%d)")
done

printf '\n%-20s %-8s %s\n' cell result versions
for row in "${results[@]}"; do
    IFS=$'\t' read -r name versions status _ <<<"$row"
    printf '%-20s %-8s %s\n' "$name" "${status%%:*}" "$versions"
done

if ((doc)); then
    printf '%s\n' "${results[@]}" | "${PYTHON:-python3}" "$root/scripts/compat/write_doc.py" \
        "$root/docs/compatibility.md" "${names[@]}"
    echo "compat-matrix: wrote docs/compatibility.md" >&2
fi
exit "$failed"
