"""The same worker (workers/launchers.py) gives the same results whichever launcher
starts it: perseusrun, mpirun (Open MPI), perseusrun --mpi, torchrun (and the older
torch.distributed.launch --use_env), and the environments Slurm's srun and MPICH-style
launchers give their tasks (simulated here: the processes are spawned with the
variables those launchers set).

Only perseusrun hosts the rendezvous itself; under every other launcher rank 0 hosts it
on PERSEUS_MASTER_PORT, a free port per test.
"""

import os
import shutil
import subprocess
import sys

import pytest
from _launch_helpers import WORKER, check_results, clean_env, free_port, run, stop_session
from perseus.runner.hosts import Host, place

pytest.importorskip("perseus._core", reason="the Perseus core (perseus._core) is not built")

PY = sys.executable
ONE_HOST = place([Host("localhost", 2)], 2)
needs_mpirun = pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="needs Open MPI's mpirun (scripts/test.sh installs Debian's openmpi-bin)")


@pytest.mark.timeout(60)
def test_perseusrun():
    rc, out = run([PY, "-m", "perseus.runner.launch", "-np", "2", PY, str(WORKER)],
                  clean_env())
    results = check_results(rc, out, ONE_HOST, "perseusrun")
    assert all(r["where"]["addr"] == "127.0.0.1" for r in results.values()), results


@pytest.mark.timeout(60)
@needs_mpirun
def test_mpirun():
    env = clean_env(PERSEUS_MASTER_PORT=free_port(), OMPI_ALLOW_RUN_AS_ROOT=1,
                    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["-x", "PYTHONPATH", "-x", "PERSEUS_MASTER_PORT", PY, str(WORKER)]
    check_results(*run(cmd, env), ONE_HOST, "mpirun")


def mpi4py_path():
    """Where mpi4py can be imported from: PERSEUS_TEST_MPI4PY (scripts/test.sh installs
    it there), else this Python's own; None when neither has it."""
    given = os.environ.get("PERSEUS_TEST_MPI4PY")
    if given and os.path.isdir(os.path.join(given, "mpi4py")):
        return given
    try:
        import mpi4py
    except ImportError:
        return None
    return os.path.dirname(os.path.dirname(mpi4py.__file__))


def mpirun_two_hosts(mode, extra_path=None):
    workers = os.path.join(os.path.dirname(str(WORKER)), "")
    path = os.pathsep.join(p for p in (clean_env()["PYTHONPATH"], workers, extra_path) if p)
    env = clean_env(PERSEUS_MASTER_PORT=free_port(), OMPI_ALLOW_RUN_AS_ROOT=1,
                    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, PYTHONPATH=path, OMP_NUM_THREADS=1)
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["-x", "PYTHONPATH", "-x", "PERSEUS_MASTER_PORT", "-x", "OMP_NUM_THREADS", PY,
            os.path.join(workers, "mpi_hosts.py"), mode]
    rc, out = run(cmd, env, timeout=90)
    assert rc == 0 and out.count("WORKER OK") == 2, out


@pytest.mark.timeout(120)
@needs_mpirun
def test_mpirun_on_several_hosts_without_master_addr_names_the_cures():
    mpirun_two_hosts("without-mpi4py")


@pytest.mark.timeout(120)
@needs_mpirun
@pytest.mark.skipif(mpi4py_path() is None,
                    reason="needs mpi4py (scripts/test.sh installs it for the tests)")
def test_mpirun_on_several_hosts_finds_rank_0_through_mpi4py():
    # seed 003's mpirun command lines give no PERSEUS_MASTER_ADDR
    mpirun_two_hosts("with-mpi4py", mpi4py_path())


@pytest.mark.timeout(60)
@needs_mpirun
def test_perseusrun_mpi():
    rc, out = run([PY, "-m", "perseus.runner.launch", "--mpi", "-np", "2", PY, str(WORKER)],
                  clean_env())
    check_results(rc, out, ONE_HOST, "perseusrun --mpi")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", [["torch.distributed.run"],
                                    ["torch.distributed.launch", "--use_env"]])
def test_torchrun(module):
    # rank 0 hosts Perseus's store on PERSEUS_MASTER_PORT beside torch's on --master_port
    env = clean_env(PERSEUS_MASTER_PORT=free_port(), OMP_NUM_THREADS=1)
    cmd = [PY, "-W", "ignore::FutureWarning", "-m", *module, "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(WORKER)]
    check_results(*run(cmd, env), ONE_HOST, " ".join(module))


def slurm_env(rank, tasks_per_node, nodes, nodelist):
    return {"SLURM_PROCID": rank, "SLURM_NTASKS": tasks_per_node * nodes,
            "SLURM_LOCALID": rank % tasks_per_node, "SLURM_NODEID": rank // tasks_per_node,
            "SLURM_NTASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1
            else tasks_per_node,
            "SLURM_NNODES": nodes, "SLURM_JOB_NODELIST": nodelist}


SIMULATED = {
    # srun on one node: the master is the first host of SLURM_JOB_NODELIST.
    "slurm": (ONE_HOST, lambda r: slurm_env(r, 2, 1, "localhost")),
    # srun on two "nodes" (both this machine): cross ranks come from SLURM_NODEID.
    "slurm-two-nodes": (place([Host("a", 1), Host("b", 1)], 2),
                        lambda r: slurm_env(r, 1, 2, "localhost,127.0.0.1")),
    # a script that sets torchrun's variables for itself under srun: ignored with
    # PERSEUS_USE_DDP_LAUNCHER=0 (WORLD_SIZE=3 would never gather).
    "slurm-ddp-vars-ignored": (ONE_HOST, lambda r: dict(
        slurm_env(r, 2, 1, "localhost"), RANK=r, WORLD_SIZE=3, LOCAL_RANK=r,
        PERSEUS_USE_DDP_LAUNCHER=0)),
    # MPICH / Intel MPI (Hydra) on one host.
    "mpich": (ONE_HOST, lambda r: {"PMI_RANK": r, "PMI_SIZE": 2, "MPI_LOCALRANKID": r,
                                   "MPI_LOCALNRANKS": 2}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", sorted(SIMULATED))
def test_simulated_launcher(launcher):
    slots, env_of = SIMULATED[launcher]
    port = free_port()
    procs = [subprocess.Popen([PY, str(WORKER)],
                              env=clean_env(PERSEUS_MASTER_PORT=port, **env_of(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for r in range(len(slots))]
    outs, codes = [], []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=40)[0])
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                outs.append(stop_session(p))
                codes.append("timeout")
    rc = next((c for c in codes if c != 0), 0)
    check_results(rc, "\n".join(outs), slots, launcher)
