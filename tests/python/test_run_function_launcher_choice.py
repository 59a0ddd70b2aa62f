"""perseus.run's choice of launcher, as horovod.run's: ``use_gloo=False`` with ``use_mpi``
unset (or False) runs Perseus's own launcher, which never needs mpirun; only
``use_mpi=True`` goes through mpirun. Whatever goes wrong is an exception of the library
(ValueError, or RuntimeError for a failed job), never a SystemExit."""

import json
import os
import subprocess
import sys
import textwrap

import perseus
import pytest
from _launch_helpers import clean_env

pytest.importorskip("perseus._core", reason="the Perseus core (perseus._core) is not built")

# Horovod's examples pass use_gloo=(args.communication == 'gloo'): False by default.
NO_MPIRUN = textwrap.dedent("""
    import json, os, shutil
    import perseus

    assert shutil.which("mpirun") is None, shutil.which("mpirun")
    print("RUN-RESULT " + json.dumps({
        str(use_mpi): perseus.run(os.getenv, args=("PERSEUS_RANK",), np=2, use_gloo=False,
                                  use_mpi=use_mpi)
        for use_mpi in (None, False)}), flush=True)
""")


def path_without_mpirun():
    """This PATH less every directory that holds an mpirun."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.access(os.path.join(d, "mpirun"), os.X_OK))


@pytest.mark.timeout(120)
def test_use_gloo_false_runs_without_mpirun_and_returns_each_ranks_result():
    proc = subprocess.run([sys.executable, "-c", NO_MPIRUN],
                          env=clean_env(PATH=path_without_mpirun()), capture_output=True,
                          text=True, timeout=100, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RUN-RESULT "))
    assert json.loads(line[len("RUN-RESULT "):]) == {"None": ["0", "1"],
                                                     "False": ["0", "1"]}, out


def test_use_gloo_and_use_mpi_together_are_refused_as_horovod_refuses_them():
    with pytest.raises(ValueError) as e:
        perseus.run(os.getpid, np=2, use_gloo=True, use_mpi=True)
    assert str(e.value) == "Argument use_gloo and use_mpi only allow one set True."


@pytest.mark.parametrize("kwargs,cause", [
    ({"start_timeout": 0}, "--start-timeout must be positive"),
    ({"ssh_port": "x"}, "argument -p/--ssh-port: invalid int value: 'x'"),
    ({"cooldown_range": (1, 2)}, "--blacklist-cooldown-range is for elastic jobs"),
])
def test_an_argument_perseusrun_refuses_is_a_value_error_naming_the_cause(capsys, kwargs,
                                                                          cause):
    try:
        perseus.run(os.getpid, np=2, **kwargs)
    except SystemExit as e:  # a BaseException: pytest.raises(ValueError) would not see it
        pytest.fail(f"perseus.run raised SystemExit({e.code!r})")
    except ValueError as e:
        assert str(e).startswith(
            f"perseus.run: perseusrun refuses these arguments: {cause}"), str(e)
    else:
        pytest.fail("perseus.run took the arguments")
    assert capsys.readouterr().err == ""  # the cause is in the exception, not on stderr


def test_use_mpi_without_mpirun_is_a_value_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no mpirun
    try:
        perseus.run(os.getpid, np=2, use_mpi=True)
    except SystemExit as e:
        pytest.fail(f"perseus.run raised SystemExit({e.code!r})")
    except ValueError as e:
        assert "needs mpirun, which is not on PATH" in str(e), str(e)
    else:
        pytest.fail("perseus.run ran without mpirun")
