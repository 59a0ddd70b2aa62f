"""The wheel as a user installs it: built by maturin, installed into a bare directory, it
imports without the repository, carries `perseusrun` and the example scripts in
`perseus/examples/` (seed 003 §2.1.2: "the package path contains example code"), and an
example runs from there on 2 ranks."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from _launch_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "python" / "perseus" / "examples"

# The seed's command for finding the examples of the installed package.
SEED_CD = ('cd `echo $(python -c "import perseus; print(perseus)") | cut -d\\\' -f 4 '
           '| sed "s/__init__.py//"`examples/ && pwd')


def _run(cmd, **kwargs):
    """``cmd`` run to its end, its output captured as text; the caller checks the status."""
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The release wheel PERSEUS_TEST_WHEEL names (a wheel, or a directory holding one:
    scripts/test.sh builds it first), else a wheel built from this checkout with the
    cargo target directory the suite shares, so only the crate itself is compiled
    again."""
    given = os.environ.get("PERSEUS_TEST_WHEEL")
    if given:
        path = Path(given)
        found = sorted(path.glob("perseus-*.whl")) if path.is_dir() else [path]
        assert len(found) == 1, f"PERSEUS_TEST_WHEEL={given}: {found}"
        return found[0]
    if shutil.which("cargo") is None:
        pytest.skip("no cargo: cannot build the wheel")
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ)
    cache = Path(os.environ.get("PERSEUS_CACHE", Path.home() / ".cache" / "perseus"))
    env.setdefault("CARGO_TARGET_DIR", str(cache / "target"))
    proc = _run([sys.executable, "-m", "maturin", "build", "--release", "--out", str(out)],
                cwd=ROOT, env=env, timeout=1500)
    assert proc.returncode == 0, f"maturin build failed\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("perseus-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_carries_the_core_the_launcher_and_every_example(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "perseus/_core.abi3.so" in names
    shipped = {n.split("/", 2)[2] for n in names
               if n.startswith("perseus/examples/") and "__pycache__" not in n}
    in_tree = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".md")}
    assert "pytorch_ddp_benchmark.py" in in_tree and "tensorflow_keras_mnist.py" in in_tree
    assert shipped == in_tree
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode().replace(" ", "")
    assert "perseusrun=perseus.runner.launch:main" in text
    assert "horovodrun=perseus.runner.launch:main" in text


def test_the_installed_wheel_runs_an_example_from_its_own_directory(wheel, tmp_path):
    site = tmp_path / "site"
    proc = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                 "--disable-pip-version-check", "--target", str(site), str(wheel)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    # Only the installed copy: no PYTHONPATH into the repository, a directory outside it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    env["PATH"] = f"{site / 'bin'}:{Path(sys.executable).parent}:{env.get('PATH', '')}"
    found = _run(["bash", "-c", SEED_CD], cwd=tmp_path, env=env, timeout=120)
    assert found.returncode == 0, found.stderr
    where = Path(found.stdout.strip())
    assert where == site / "perseus" / "examples"
    launcher = site / "bin" / "perseusrun"
    assert launcher.exists()
    run = _run([str(launcher), "-np", "2", "-H", "localhost:2", sys.executable,
                "pytorch_mnist.py", "--epochs", "1", "--train-size", "512", "--test-size", "256"],
               cwd=where, env=env, timeout=240)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "[0]<stdout>:final loss" in run.stdout, run.stdout
    # Both ranks ran the installed core, not the repository's.
    probe = _run([sys.executable, "-c", "import perseus._core as c; print(c.__file__)"],
                 cwd=tmp_path, env=env, timeout=60)
    assert probe.stdout.strip().startswith(str(site)), probe


PLAIN_DDP = """\
import os, sys
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
hooked = "perseus" in sys.modules and sys.modules["perseus.torch.ddp"].hooked(model)
print(f"rank {dist.get_rank()}: perseus imported {'perseus' in sys.modules}, "
      f"gradients through perseus {hooked}", flush=True)
# torch 2.15's gloo teardown races at exit ("terminate called without an active
# exception", plain DDP without Perseus too; workers/ddp_amp.py): end without it.
dist.barrier()
os._exit(0)
"""


def _venv_with_the_wheel(wheel, tmp_path):
    """A new virtual environment holding the wheel, and torch from the suite's own
    (after the wheel's .pth files ran); its python and an environment for it."""
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(_run([str(python), "-c", where], timeout=60).stdout.strip())
    proc = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                 "--disable-pip-version-check", "--target", str(purelib), str(wheel)],
                timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (purelib / "perseus_aiak_activation.pth").exists()
    (purelib / "zz-test-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("AIAK_", "PERSEUS_"))}
    return python, env


AIAK_NAMES_PROBE = """
import sys
print("at start", "torch" in sys.modules, "perseus" in sys.modules)
import torch
print("after torch", "perseus" in sys.modules)
lamb, decorate = torch.optim.LAMB, torch.cuda.amp.aiak_amp_decorate
from perseus.torch import amp, optim
print("names", lamb is optim.LAMB, decorate is amp.amp_decorate,
      torch.cuda.amp.aiak_amp_parameters is amp.amp_parameters)
try:
    torch.optim.NoSuchName
except AttributeError as e:
    print("others", "NoSuchName" in str(e))
"""


def test_aiak_names_are_in_torch_whenever_it_is_imported(wheel, tmp_path):
    """AIAK-Training's torch had torch.optim.LAMB and torch.cuda.amp.aiak_amp_* built in:
    with the wheel installed they are there without import perseus, and a process
    loads nothing of Perseus until it reads one."""
    python, env = _venv_with_the_wheel(wheel, tmp_path)
    out = _run([str(python), "-c", AIAK_NAMES_PROBE], env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.split()[0] in
             ("at", "after", "names", "others")]
    assert lines == ["at start False False", "after torch False", "names True True True",
                     "others True"], out.stdout


def test_seed_001s_variables_alone_bring_perseus_into_a_plain_ddp_script(wheel, tmp_path):
    """Seed 001: its variables act "without modifying the code". The wheel's
    perseus_aiak_activation.pth imports perseus at start-up when one is set (and only
    then), so a DDP script that never names perseus reduces through it."""
    python, env = _venv_with_the_wheel(wheel, tmp_path)
    probe = "import sys; print('perseus' in sys.modules)"
    for value, imported in (("1", "True"), ("0", "False"), (None, "False")):
        extra = {} if value is None else {"AIAK_FP16_COMPRESSION": value}
        out = _run([str(python), "-c", probe], env={**env, **extra}, cwd=tmp_path, timeout=60)
        assert out.stdout.strip() == imported, (value, out.stdout, out.stderr)
    script = tmp_path / "plain_ddp.py"
    script.write_text(PLAIN_DDP)
    # (any AIAK_ variable acts alike: the probes above showed one; a job each way here)
    for var in ("AIAK_HIERARCHICAL_ALLREDUCE", None):
        extra = {} if var is None else {var: "1"}
        run = _run([str(python), "-W", "ignore::FutureWarning", "-m", "torch.distributed.run",
                    "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)],
                   env={**env, **extra, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, timeout=120)
        assert run.returncode == 0, f"{var}\n{run.stdout}\n{run.stderr}"
        on = "True" if var else "False"
        for r in (0, 1):
            assert f"rank {r}: perseus imported {on}, gradients through perseus {on}" \
                in run.stdout, (var, run.stdout, run.stderr)

