#!/usr/bin/env bash
# Usage: scripts/build-wheel.sh [--target TRIPLE] [--out DIR]
#
# Builds the release artifacts into DIR (default dist/):
#   perseus-<version>-cp39-abi3-manylinux2014_<arch>.manylinux_2_17_<arch>.whl
#     one abi3 wheel for CPython 3.9 and newer, linked by zig against glibc 2.17, so pip
#     installs it on any Linux with glibc 2.17 or newer (CentOS 7, Ubuntu 16.04+, ...)
#   perseus-<version>.tar.gz   the sdist (the wheel is built from it, which proves it whole)
# then refuses the wheel (exit 1, nothing written to DIR) unless its tags say
# manylinux2014/manylinux_2_17 and abi3 and `auditwheel show` agrees that it complies.
#
#   --target TRIPLE  a Rust target, passed to maturin (e.g. aarch64-unknown-linux-gnu);
#                    its standard library must be installed (rustup target add TRIPLE)
#   --out DIR        where the wheel and the sdist go (default: dist/ in the repository)
#
# The tools (requirements/build.txt: maturin, ziglang, auditwheel) live in their own
# virtual environment, made once, as scripts/setup-venv.sh makes the others:
#   ${PERSEUS_CACHE:-~/.cache/perseus}/venv-build-<sha256 of requirements/build.txt, 12 hex>
# cargo's target directory is ${PERSEUS_CACHE}/target-wheel: zig links differently from
# `maturin develop`, so sharing ${PERSEUS_CACHE}/target would rebuild both each time.
# PYTHON picks the base interpreter of the venv (any CPython 3.9 or newer).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "build-wheel: $*" >&2; exit 1; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
target=""
out="$root/dist"
while (($#)); do
    case $1 in
        --target) target=${2:?--target needs a Rust target triple}; shift 2 ;;
        --target=*) target=${1#*=}; shift ;;
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        --out=*) out=${1#*=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done

command -v rustc >/dev/null || die "no rustc on PATH: install Rust (https://rustup.rs)"
host=$(rustc -vV | sed -n 's/^host: //p')
triple=${target:-$host}

# The manylinux architecture name of the target.
case $triple in
    x86_64-*-linux-gnu*) arch=x86_64 ;;
    aarch64-*-linux-gnu*) arch=aarch64 ;;
    i686-*-linux-gnu*) arch=i686 ;;
    powerpc64le-*-linux-gnu*) arch=ppc64le ;;
    s390x-*-linux-gnu*) arch=s390x ;;
    armv7-*-linux-gnueabihf) arch=armv7l ;;
    *) die "target $triple: not a glibc Linux target with a manylinux2014 policy" ;;
esac

# The target's standard library must be there (cargo's own error says much less).
if [[ $triple != "$host" ]]; then
    missing="the Rust standard library for $triple is not installed; run:
    rustup target add $triple"
    if command -v rustup >/dev/null; then
        rustup target list --installed | grep -qxF "$triple" || die "$missing"
    fi
    libdir=$(rustc --print target-libdir --target "$triple" 2>/dev/null) || die "$missing"
    compgen -G "$libdir/libstd-*.rlib" >/dev/null || die "$missing"
fi

cache=${PERSEUS_CACHE:-$HOME/.cache/perseus}
venv=$(bash "$root/scripts/make-venv.sh" build "$root/requirements/build.txt" | tail -n 1)
python="$venv/bin/python"

if command -v git >/dev/null && git -C "$root" rev-parse --git-dir >/dev/null 2>&1 &&
    [[ -n $(git -C "$root" --no-optional-locks status --porcelain 2>/dev/null) ]]; then
    echo "build-wheel: note: the working tree has uncommitted changes; the sdist and the" \
        "wheel carry them (and its untracked files that .gitignore does not name)" >&2
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
stage=$(mktemp -d "$out/.build-wheel.XXXXXX")
trap 'rm -rf "$stage"' EXIT

# --sdist: maturin writes the sdist, then builds the wheel from it, unpacked elsewhere.
# --zig with manylinux2014: zig links against glibc 2.17's symbols. The cuda feature
# (pyproject.toml) opens CUDA's libraries with dlopen at run time, so it links none.
echo "build-wheel: building for $triple (manylinux2014, abi3) in $cache/target-wheel" >&2
args=(build --release --sdist --zig --compatibility manylinux2014 --auditwheel check
      --out "$stage")
[[ -n $target ]] && args+=(--target "$target")
(
    cd "$root"
    # The wheel is built from the unpacked sdist, whose files carry the sdist's fixed
    # times: cargo would take the last build's perseus for current and ship it. So
    # perseus (not its dependencies) is always compiled anew.
    CARGO_TARGET_DIR="$cache/target-wheel" cargo clean --release -p perseus --target "$triple"
    PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$cache/target-wheel" "$python" -m maturin "${args[@]}"
) >&2

shopt -s nullglob
wheels=("$stage"/perseus-*.whl)
sdists=("$stage"/perseus-*.tar.gz)
((${#wheels[@]} == 1)) || die "expected one wheel in $stage, found ${#wheels[@]}"
((${#sdists[@]} == 1)) || die "expected one sdist in $stage, found ${#sdists[@]}"
wheel=${wheels[0]}
sdist=${sdists[0]}

# Its tags, as pip reads them: every Tag line of the WHEEL file must be cp39-abi3 with
# manylinux2014_<arch> or manylinux_2_17_<arch>, and both must be there.
"$python" - "$wheel" "$arch" <<'PY' || die "$(basename "$wheel"): not a manylinux2014 abi3 wheel"
import sys
import zipfile

path, arch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(path) as z:
    name = next(n for n in z.namelist()
                if n.count("/") == 1 and n.endswith(".dist-info/WHEEL"))
    meta = z.read(name).decode()
tags = [line.split(":", 1)[1].strip() for line in meta.splitlines()
        if line.startswith("Tag:")]
want = {f"cp39-abi3-manylinux2014_{arch}", f"cp39-abi3-manylinux_2_17_{arch}"}
print(f"build-wheel: WHEEL tags: {', '.join(tags) or 'none'}", file=sys.stderr)
if set(tags) != want:
    print(f"build-wheel: expected exactly {', '.join(sorted(want))}", file=sys.stderr)
    sys.exit(1)
PY

# auditwheel's verdict: the most compatible policy the wheel satisfies (its external
# libraries within the policy's whitelist, its symbol versions at most the policy's) must
# be manylinux_2_17 or an older one. A library outside every whitelist (libcuda,
# libnccl, ...) would make it linux_<arch>.
report=$("$venv/bin/auditwheel" show "$wheel" 2>&1) || {
    echo "$report" >&2
    die "auditwheel show failed on $(basename "$wheel")"
}
echo "$report" >&2
"$python" - "$report" "$arch" <<'PY' || die "auditwheel: $(basename "$wheel") is not consistent with manylinux2014 (manylinux_2_17_$arch)"
import re
import sys

report, arch = " ".join(sys.argv[1].split()), sys.argv[2]
found = re.search(r'consistent with the following platform tag: "([^"]+)"', report)
tag = found.group(1) if found else "none"
legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
glibc = (int(m.group(1)), int(m.group(2))) if m else None
if glibc is None and tag.endswith(f"_{arch}"):
    glibc = legacy.get(tag[: -len(arch) - 1])
if glibc is None or glibc > (2, 17) or not tag.endswith(f"_{arch}"):
    print(f"build-wheel: auditwheel says the wheel is consistent with {tag!r}, which is "
          f"not manylinux2014 / manylinux_2_17_{arch} or older", file=sys.stderr)
    sys.exit(1)
print(f"build-wheel: auditwheel: consistent with {tag} (manylinux_2_17_{arch} or older: ok)",
      file=sys.stderr)
PY

mv -f "$wheel" "$sdist" "$out"/
echo "wheel: $out/$(basename "$wheel")"
echo "sdist: $out/$(basename "$sdist")"
