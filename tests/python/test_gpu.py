"""The GPU path without a GPU (issue: the wheel imports everywhere; CUDA is found at run
time): library discovery by real file names, clear errors when a library is missing,
and every device kernel source compiled by NVRTC from torch's nvidia wheels."""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch
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
              "nonfinite_f32", "radix_histogram", "select_at_least", "sgd", "adam",
              "sum_squares", "lamb_stage1", "lamb_stage2"):
        assert k in kernels, (k, kernels)
    assert all(c["bytes"] > 100 for c in compiled), compiled


@pytest.mark.parametrize("sm", [75, 80, 90])
def test_every_kernel_source_compiles_to_a_cubin_per_architecture(sm):
    """A device loads a CUBIN of its own architecture (no PTX JIT, whatever its driver)."""
    if not wheel_has("libnvrtc.so*"):
        pytest.skip("no nvidia NVRTC wheel in this environment")
    compiled = gpu.compile_kernels(sm=sm)
    assert len(compiled) == 6
    assert all(c["bytes"] > 1000 for c in compiled), compiled


def test_a_second_nvrtc_on_the_loader_path_is_never_used(tmp_path):
    """cudarc looks for the unversioned libnvrtc.so before the versioned names, so Perseus
    calls NVRTC through its own handle to the file it chose: another file of that name on
    the loader's path (an older toolkit's) is never loaded, and the kernels compile with
    the NVRTC that libraries() reports."""
    wheel = [p for d in gpu.library_dirs() for p in glob.glob(os.path.join(d, "libnvrtc.so.1[23]"))]
    if not wheel:
        pytest.skip("no nvidia NVRTC wheel in this environment")
    other = tmp_path / "libnvrtc.so"
    shutil.copyfile(wheel[0], other)  # a copy is another file to the loader; a link is not
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path), PYTHONPATH=PKG_ROOT)
    code = ("from perseus.common import gpu\n"
            "compiled = gpu.compile_kernels()\n"
            "print('COMPILED', len(compiled))\n"
            "print('NVRTC', [l['path'] for l in gpu.libraries() if l['name'] == 'NVRTC'][0])\n"
            f"print('MAPPED', {str(other)!r} in open('/proc/self/maps').read())\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "COMPILED 6" in out.stdout, out.stdout
    assert f"NVRTC {wheel[0]}" in out.stdout, out.stdout
    assert "MAPPED False" in out.stdout, out.stdout


def test_a_device_newer_than_nvrtc_gets_ptx_and_an_older_one_a_clear_error():
    """A device whose architecture NVRTC does not know (newer than it) gets PTX for the
    newest one it has, which the driver compiles; one older than every architecture it
    has is a GpuUnavailableError naming them, not an argument error or a panic."""
    if not wheel_has("libnvrtc.so*"):
        pytest.skip("no nvidia NVRTC wheel in this environment")
    compiled = gpu.compile_kernels(sm=999)
    assert len(compiled) == 6 and all(c["bytes"] > 100 for c in compiled), compiled
    with pytest.raises(gpu.GpuUnavailableError, match="none of which a device of sm_10 runs"):
        gpu.compile_kernels(sm=10)


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


def test_opening_a_device_without_the_driver_is_a_clear_error():
    probe = run_core("from perseus import _core; "
                     "print(_core.gpu_libraries([])[0]['path'])")
    assert probe.returncode == 0, probe.stderr
    if probe.stdout.strip() != "None":
        pytest.skip("a CUDA driver is installed here")
    out = run_core("from perseus.common import gpu\n"
                   "assert gpu.built()\n"
                   "for call in (lambda: gpu.stream(0),\n"
                   "             lambda: gpu._core.gpu_nccl_round_trip(0)):\n"
                   "    try:\n"
                   "        call()\n"
                   "    except gpu.GpuUnavailableError as e:\n"
                   "        print('ERROR', e)\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ERROR CUDA driver (libcuda.so.1 or libcuda.so) was not found; "
                            "searched:") == 2, out.stdout


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
GPU_JOB = {"PERSEUS_CHANGE_HVD_ALLGATHER": "1"}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_sharing_one_gpu_through_the_host_staged_path(run_workers, n):
    run_workers(n, "gpu_staged.py", env=dict(GPU_JOB, CUDA_VISIBLE_DEVICES="0"))


@pytest.mark.gpu
@needs_gpu
def test_float16_cast_on_the_device_overflow_and_nan_check(run_workers):
    run_workers(2, "gpu_staged.py", "half",
                env=dict(GPU_JOB, CUDA_VISIBLE_DEVICES="0", PERSEUS_ALLREDUCE_DTYPE="0",
                         PERSEUS_ALLREDUCE_NANCHECK="1"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("streams", ["1", "3"])
def test_a_rank_on_its_own_gpu_goes_over_nccl(run_workers, streams):
    """One rank on one GPU: allreduce (fused, scaled, split across PERSEUS_ALLREDUCE_STREAMS
    communicators) and broadcast of CUDA tensors run over NCCL; the counter says so."""
    if not wheel_has("libnccl.so*"):
        pytest.skip("no nvidia NCCL wheel in this environment")
    run_workers(1, "gpu_staged.py",
                env=dict(GPU_JOB, CUDA_VISIBLE_DEVICES="0", PERSEUS_ALLREDUCE_STREAMS=streams))


@pytest.mark.gpu
@needs_gpu
def test_nccl_required_on_a_shared_gpu_fails_on_every_rank_naming_why(run_workers):
    run_workers(2, "gpu_staged.py", "required",
                env=dict(GPU_JOB, CUDA_VISIBLE_DEVICES="0", PERSEUS_NCCL_ENABLE="1"))


@pytest.mark.gpu
@needs_gpu
def test_one_rank_nccl_communicator_round_trip():
    if not wheel_has("libnccl.so*"):
        pytest.skip("no nvidia NCCL wheel in this environment")
    gpu._core.gpu_search_dirs(gpu.library_dirs())
    report = gpu._core.gpu_nccl_round_trip(0)
    assert "came back unchanged" in report, report


CONTEXT_CHECK = """
NCCL = %s
import ctypes, threading, torch
from perseus.common import gpu
import perseus.torch.kernels as kernels
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
def current():
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value
seen = []
def fresh_thread():
    seen.append(("before", current()))
    gpu.stream(0)  # opens the device: the first call in this process
    seen.append(("stream", current()))
    if NCCL:
        gpu._core.gpu_nccl_round_trip(0)
        seen.append(("nccl", current()))
t = threading.Thread(target=fresh_thread)
t.start()
t.join()
print("FRESH", all(ctx is None for _, ctx in seen), seen)
if torch.cuda.device_count() >= 2:
    torch.cuda.set_device(1)
    x = torch.ones(1000, device="cuda:0")
    kernels.scale_(x, 2.0)
    gpu._core.gpu_nccl_round_trip(0) if NCCL else None
    print("TORCH_DEVICE", torch.cuda.current_device())
"""


@pytest.mark.gpu
@needs_gpu
def test_calls_on_a_callers_thread_leave_its_current_context_as_it_was():
    """Opening a device, the NCCL round trip and a kernel call make Perseus's context
    current only while they run: a thread without one has none after them, and torch's
    current device stays what the caller set."""
    code = CONTEXT_CHECK % wheel_has("libnccl.so*")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False, env=dict(os.environ, PYTHONPATH=PKG_ROOT))
    assert out.returncode == 0, out.stderr
    assert "FRESH True" in out.stdout, out.stdout
    if torch.cuda.device_count() >= 2:
        assert "TORCH_DEVICE 1" in out.stdout, out.stdout


def test_check_build_lists_the_gpu_libraries():
    out = subprocess.run([sys.executable, "-m", "perseus.runner.launch", "--check-build"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, PYTHONPATH=PKG_ROOT))
    assert out.returncode == 0, out.stderr
    for name in ("CUDA driver", "NVRTC", "NCCL"):
        assert name in out.stdout, out.stdout
