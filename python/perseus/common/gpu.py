"""Where the GPU path finds CUDA (docs/gpu.md), framework-neutral.

The core loads the CUDA driver, NVRTC and NCCL at run time. It looks first in the
``nvidia/*/lib`` folders of the installed nvidia-* wheels (those torch installs: CUDA 12's
``nvidia/cuda_nvrtc/lib``, ``nvidia/nccl/lib``, CUDA 13's ``nvidia/cu13/lib``), then in
``LD_LIBRARY_PATH``, ``CUDA_HOME``/``CUDA_PATH`` and the system's usual places. Where a
CUDA driver is found, the core picks the NVRTC that suits it across all these folders
(NVRTC 12 under a CUDA 12 driver, even where CUDA 13's wheel comes first here).
"""

import glob
import os
import sys

from perseus import _core

GpuUnavailableError = _core.GpuUnavailableError


def library_dirs():
    """The nvidia-* wheels' library folders on ``sys.path``, in ``sys.path`` order."""
    dirs = []
    for entry in sys.path:
        for pattern in ("nvidia/*/lib", "nvidia/*/lib64"):
            for d in sorted(glob.glob(os.path.join(entry or ".", pattern))):
                if os.path.isdir(d) and d not in dirs:
                    dirs.append(d)
    return dirs


def libraries():
    """Each GPU library: a dict with ``name``, ``files``, ``path`` and ``version`` (None
    when missing) and ``missing`` (why, with every place searched)."""
    return _core.gpu_libraries(library_dirs())


def compile_kernels(sm=None):
    """Compile every device kernel source with NVRTC, to PTX or, with ``sm`` (90 for an
    H100), to CUBINs for that architecture; a dict per source (``source``, ``kernels``,
    ``bytes``). Raises :class:`GpuUnavailableError` without NVRTC."""
    return _core.gpu_compile_kernels(library_dirs(), sm)


def built():
    """True when this build of Perseus has the GPU path (the ``cuda`` cargo feature)."""
    return bool(_core.GPU_BUILT)


_streams = {}


def stream(device):
    """Perseus's CUDA stream on device ``device`` (an ordinal), as an integer for
    ``__dlpack__(stream=...)``. The device is opened the first time; raises
    :class:`GpuUnavailableError` without the CUDA driver."""
    s = _streams.get(device)
    if s is None:
        _core.gpu_search_dirs(library_dirs())
        s = _streams[device] = _core.gpu_stream(device)
    return s


def report_lines():
    """One line per library for ``perseusrun --check-build``."""
    lines = []
    for lib in libraries():
        if lib["path"] is not None:
            lines.append(f"    [X] {lib['name']} {lib['version']} ({lib['path']})")
        else:
            lines.append(f"    [ ] {lib['name']}: not found ({' or '.join(lib['files'])})")
    return lines
