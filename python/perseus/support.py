"""The framework versions Perseus supports, written down once, and the check that each
front-end makes at import (docs/compatibility.md).

``SUPPORTED`` holds, for each framework, the oldest release that works and the newest
that the compatibility matrix (scripts/compat-matrix.sh) has run. An older framework is
an ImportError naming its version and the range; a newer one than any tested gets one
warning per process and goes on.
"""

import re
import warnings

#: Framework: (oldest supported, newest tested), as ``major.minor[.patch]``.
SUPPORTED = {
    "torch": ("2.1", "2.15"),
    "tensorflow": ("2.16", "2.21"),
    "mxnet": ("1.9.1", "1.9.1"),
}

#: Python: (oldest, newest) minor versions the wheel is tested on.
PYTHONS = ("3.9", "3.13")

_warned = set()


class NewerThanTestedWarning(UserWarning):
    """The framework is newer than any release Perseus has been tested with."""


def parse(version):
    """The leading numbers of a version string as a tuple: ``"2.15.0+cu128"`` is
    ``(2, 15, 0)``, ``"2.4.0a0"`` is ``(2, 4, 0)``, ``"1.9.1"`` is ``(1, 9, 1)``."""
    numbers = re.match(r"\d+(?:\.\d+)*", str(version).strip())
    if numbers is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in numbers.group(0).split("."))


def _pad(version, length):
    return version + (0,) * (length - len(version))


def older(version, oldest):
    """Whether ``version`` is before ``oldest`` (both strings; a pre-release of the oldest
    release counts as that release)."""
    have, want = parse(version), parse(oldest)
    return _pad(have, 3) < _pad(want, 3)


def newer(version, newest):
    """Whether ``version`` is a later major.minor series than ``newest`` (patch releases of
    the newest tested series count as tested)."""
    return _pad(parse(version), 2)[:2] > _pad(parse(newest), 2)[:2]


def span(framework):
    """The supported range as text: ``"2.1 to 2.15"``, or ``"1.9.1"`` for one release."""
    oldest, newest = SUPPORTED[framework]
    return oldest if oldest == newest else f"{oldest} to {newest}"


def check(framework, version):
    """Refuses a framework older than :data:`SUPPORTED` allows (ImportError naming the
    version and the range) and warns once per process of one newer than any tested."""
    oldest, newest = SUPPORTED[framework]
    if older(version, oldest):
        raise ImportError(
            f"Perseus supports {framework} {span(framework)}; this is {framework} "
            f"{version}. Upgrade {framework} (pip install '{framework}>={oldest}') or see "
            f"docs/compatibility.md for why older releases cannot work.")
    if newer(version, newest) and framework not in _warned:
        _warned.add(framework)
        warnings.warn(
            f"{framework} {version} is newer than any release Perseus has been tested with "
            f"({framework} {span(framework)}); it may work. Report what fails, with "
            f"perseusrun --check-build's output.", NewerThanTestedWarning, stacklevel=3)

