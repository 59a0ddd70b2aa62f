"""The GPU path without a GPU (issue: the wheel imports everywhere; CUDA is found at run
time): library discovery by real file names, clear errors when a library is missing,
and every device kernel source compiled by NVRTC from torch's nvidia wheels."""

import glob
import os
import subprocess
import sys

import pytest
from perseus.common import gpu

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(gpu.__file__))))


def wheel_has(pattern):
    return any(glob.glob(os.path.join(d, pattern)) for d in gpu.library_dirs())


def test_libraries_are_reported_by_name_path_and_version():
    libs = {lib["name"]: lib for lib in gpu.libraries()}
    assert set(libs) == {"CUDA driver", "NVRTC", "NCCL"}
    assert libs["NCCL"]["files"][0] == "libnccl.so.2"
    for lib in libs.values():
        if lib["path"] is None:
            assert "was not found; searched:" in lib["missing"], lib
            assert lib["files"][0] in lib["missing"], lib
        else:
            assert lib["version"] and lib["missing"] is None, lib
    if wheel_has("libnccl.so.2"):
        assert libs["NCCL"]["path"].endswith("libnccl.so.2"), libs["NCCL"]
        assert libs["NCCL"]["version"].startswith("2."), libs["NCCL"]
    if wheel_has("libnvrtc.so.1[23]"):
        assert libs["NVRTC"]["version"].split(".")[0] in ("12", "13"), libs["NVRTC"]


def test_every_kernel_source_compiles_with_nvrtc():
    if not wheel_has("libnvrtc.so*"):
        pytest.skip("no nvidia NVRTC wheel in this environment")
    compiled = gpu.compile_kernels()
    names = {c["source"] for c in compiled}
    assert names == {"cast", "reduce", "scale", "nancheck", "dgc", "optimizers"}, names
    kernels = {k for c in compiled for k in c["kernels"]}
    for k in ("f32_to_f16_scaled", "f32_to_bf16_scaled", "reduce_f16", "scale_f32",
              "nonfinite_f32", "count_at_least", "sgd", "adam", "lamb_direction", "lamb_apply"):
        assert k in kernels, (k, kernels)
    assert all(c["ptx_bytes"] > 100 for c in compiled), compiled


def run_core(code):
    env = dict(os.environ, LD_LIBRARY_PATH="", CUDA_HOME="", CUDA_PATH="",
               PYTHONPATH=PKG_ROOT)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_a_missing_library_is_a_clear_python_error():
    probe = run_core("from perseus import _core; "
                     "print([l['path'] for l in _core.gpu_libraries(['/nonexistent'])])")
    assert probe.returncode == 0, probe.stderr
    if "None" not in probe.stdout.split(",")[1]:
        pytest.skip("NVRTC is installed system-wide here")
    out = run_core("from perseus import _core\n"
                   "try:\n"
                   "    _core.gpu_compile_kernels(['/nonexistent'])\n"
                   "except _core.GpuUnavailableError as e:\n"
                   "    print('ERROR', e)\n")
    assert out.returncode == 0, out.stderr  # an exception, not a crash or a panic
    assert "ERROR NVRTC (libnvrtc.so.13 or libnvrtc.so.12 or libnvrtc.so) was not found" \
        in out.stdout, out.stdout
    assert "/nonexistent" in out.stdout, out.stdout


def test_check_build_lists_the_gpu_libraries():
    out = subprocess.run([sys.executable, "-m", "perseus.runner.launch", "--check-build"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, PYTHONPATH=PKG_ROOT))
    assert out.returncode == 0, out.stderr
    for name in ("CUDA driver", "NVRTC", "NCCL"):
        assert name in out.stdout, out.stdout
