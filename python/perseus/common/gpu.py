"""Where the GPU path finds CUDA (docs/gpu.md), framework-neutral.

The core loads the CUDA driver, NVRTC and NCCL at run time. It looks first in the
``nvidia/*/lib`` folders of the installed nvidia-* wheels (those torch installs: CUDA 12's
``nvidia/cuda_nvrtc/lib``, ``nvidia/nccl/lib``, CUDA 13's ``nvidia/cu13/lib``), then in
``LD_LIBRARY_PATH``, ``CUDA_HOME``/``CUDA_PATH`` and the system's usual places.
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


def compile_kernels():
    """Compile every device kernel source with NVRTC; a dict per source (``source``,
    ``kernels``, ``ptx_bytes``). Raises :class:`GpuUnavailableError` without NVRTC."""
    return _core.gpu_compile_kernels(library_dirs())


def report_lines():
    """One line per library for ``perseusrun --check-build``."""
    lines = []
    for lib in libraries():
        if lib["path"] is not None:
            lines.append(f"    [X] {lib['name']} {lib['version']} ({lib['path']})")
        else:
            lines.append(f"    [ ] {lib['name']}: not found ({' or '.join(lib['files'])})")
    return lines
