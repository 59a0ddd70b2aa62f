"""The release wheel (scripts/build-wheel.sh) is one portable manylinux2014 abi3 wheel.

Skipped unless PERSEUS_TEST_WHEEL names a built wheel (or a directory holding one
perseus-*.whl, such as dist/):

    bash scripts/build-wheel.sh
    PERSEUS_TEST_WHEEL=dist python -m pytest tests/python/test_wheel.py

It reads the wheel's WHEEL metadata (the tags pip goes by), reads the core's ELF dynamic
section (the libraries and glibc symbol versions it needs: the manylinux2014 whitelist
and glibc 2.17 at most, no CUDA library, which is opened with dlopen at run time), and,
where auditwheel is importable, asks `auditwheel show` too.
"""

import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not os.environ.get("PERSEUS_TEST_WHEEL"),
    reason="PERSEUS_TEST_WHEEL does not name a built wheel (scripts/build-wheel.sh)")

# auditwheel 6.8's manylinux2014 (manylinux_2_17) whitelist, and the dynamic loaders,
# which every policy allows.
WHITELIST = {
    "libatomic.so.1", "libgcc_s.so.1", "libstdc++.so.6", "libm.so.6", "libanl.so.1",
    "libdl.so.2", "librt.so.1", "libc.so.6", "libnsl.so.1", "libutil.so.1",
    "libpthread.so.0", "libX11.so.6", "libXext.so.6", "libXrender.so.1", "libICE.so.6",
    "libSM.so.6", "libGL.so.1", "libgobject-2.0.so.0", "libgthread-2.0.so.0",
    "libglib-2.0.so.0", "libresolv.so.2", "libexpat.so.1", "libz.so.1",
}
LOADERS = {"ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "ld64.so.2", "ld64.so.1",
           "ld-linux.so.2", "ld-linux-armhf.so.3"}
# The newest symbol version of each kind that manylinux2014 allows (x86_64's policy).
NEWEST = {"GLIBC": (2, 17), "GLIBCXX": (3, 4, 19), "CXXABI": (1, 3, 7), "GCC": (4, 8, 0)}
CORE = "perseus/_core.abi3.so"


@pytest.fixture(scope="module")
def wheel():
    path = Path(os.environ["PERSEUS_TEST_WHEEL"])
    if path.is_dir():
        found = sorted(path.glob("perseus-*.whl"), key=lambda p: p.stat().st_mtime)
        assert found, f"no perseus-*.whl in {path}"
        path = found[-1]
    assert path.is_file(), f"PERSEUS_TEST_WHEEL={path}: no such file"
    return path


def _arch(wheel):
    # perseus-0.1.0-cp39-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
    platform = wheel.name[:-len(".whl")].split("-")[-1]
    return platform.split(".")[0].split("_", 1)[1]


def _wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist()
                    if n.count("/") == 1 and n.endswith(".dist-info/WHEEL"))
        return z.read(name).decode()


def test_the_wheel_is_tagged_abi3_manylinux2014(wheel):
    arch = _arch(wheel)
    want = {f"cp39-abi3-manylinux2014_{arch}", f"cp39-abi3-manylinux_2_17_{arch}"}
    meta = _wheel_metadata(wheel)
    tags = {line.split(":", 1)[1].strip() for line in meta.splitlines()
            if line.startswith("Tag:")}
    assert tags == want, meta
    assert "Root-Is-Purelib: false" in meta, meta
    # The file name carries the same tags (pip reads those first).
    _, _, python, abi, platforms = wheel.name[:-len(".whl")].split("-")
    assert (python, abi) == ("cp39", "abi3"), wheel.name
    assert set(platforms.split(".")) == {f"manylinux2014_{arch}", f"manylinux_2_17_{arch}"}


def _elf_needs(data):
    """(DT_NEEDED names, {library: {symbol versions}}) of a 64-bit ELF shared object."""
    assert data[:4] == b"\x7fELF", "not an ELF file"
    if data[4] != 2:
        pytest.skip("a 32-bit ELF: this reader takes 64-bit ones (auditwheel checks it)")
    end = "<" if data[5] == 1 else ">"
    shoff, = struct.unpack_from(end + "Q", data, 0x28)
    shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
    sections = [struct.unpack_from(end + "IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]

    def string(strtab, offset):
        start = sections[strtab][4] + offset
        return data[start:data.index(b"\0", start)].decode()

    needed, versions = [], {}
    for _name, kind, _flags, _addr, offset, size, link, info, _align, _entsize in sections:
        if kind == 6:  # SHT_DYNAMIC
            for pos in range(offset, offset + size, 16):
                tag, value = struct.unpack_from(end + "qQ", data, pos)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(string(link, value))
        elif kind == 0x6FFFFFFE:  # SHT_GNU_verneed
            pos = offset
            for _ in range(info):
                _version, count, file, aux, following = struct.unpack_from(end + "HHIII", data,
                                                                           pos)
                names = versions.setdefault(string(link, file), set())
                apos = pos + aux
                for _ in range(count):
                    _hash, _flags2, _other, name, anext = struct.unpack_from(end + "IHHII",
                                                                             data, apos)
                    names.add(string(link, name))
                    apos += anext
                pos += following
    return needed, versions


def test_the_core_links_only_what_manylinux2014_allows(wheel):
    with zipfile.ZipFile(wheel) as z:
        needed, versions = _elf_needs(z.read(CORE))
    assert "libc.so.6" in needed, needed
    outside = sorted(set(needed) - WHITELIST - LOADERS)
    assert not outside, f"{CORE} links libraries outside manylinux2014: {outside}"
    # The GPU path opens CUDA's libraries at run time (docs/gpu.md), never at load time.
    assert not [n for n in needed if re.search(r"cuda|nccl|nvrtc", n)], needed
    too_new = []
    for library, names in versions.items():
        for name in names:
            kind, _, number = name.partition("_")
            if kind == "CXXABI" and number == "TM_1":
                continue
            known = kind in NEWEST and re.fullmatch(r"\d+(\.\d+)*", number)
            if not known or tuple(map(int, number.split("."))) > NEWEST[kind]:
                too_new.append(f"{library}: {name}")
    assert not too_new, f"{CORE} needs symbol versions newer than manylinux2014: {too_new}"
    assert any(n.startswith("GLIBC_") for n in versions.get("libc.so.6", ())), versions


def test_auditwheel_finds_it_consistent_with_manylinux_2_17(wheel):
    pytest.importorskip("auditwheel")
    proc = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    report = " ".join(proc.stdout.split())
    found = re.search(r'consistent with the following platform tag: "([^"]+)"', report)
    assert found, proc.stdout
    arch = _arch(wheel)
    legacy = {f"manylinux1_{arch}": (2, 5), f"manylinux2010_{arch}": (2, 12),
              f"manylinux2014_{arch}": (2, 17)}
    tag = found.group(1)
    m = re.fullmatch(rf"manylinux_(\d+)_(\d+)_{arch}", tag)
    glibc = (int(m.group(1)), int(m.group(2))) if m else legacy.get(tag)
    assert glibc is not None and glibc <= (2, 17), proc.stdout
