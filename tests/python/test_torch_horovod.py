"""``perseus.torch.horovod`` (the horovod.torch API) on 2 and 3 ranks.

Each test launches one worker script in tests/python/workers/ that runs many
checks and exits non-zero on the first failure.
"""

import json

import pytest

pytest.importorskip("torch")

SIZES = [2, 3]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mode", ["0", "1"])
def test_collectives_and_process_sets(run_workers, n, mode):
    """Values after every collective, dtype and op; process sets; join; objects; timeline."""
    run_workers(n, "collectives.py", env={"PERSEUS_CHANGE_HVD_ALLGATHER": mode})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", SIZES)
def test_errors(run_workers, n):
    """Use before init, bad arguments, mismatched requests, duplicate names."""
    run_workers(n, "errors.py")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n,mode", [(2, "1"), (3, "1"), (2, "0"), (3, "0")])
def test_horovod_dtypes_and_gradients(run_workers, n, mode):
    """Every dtype Horovod accepts (int16 and uint16 among them) through every collective,
    and every differentiable op's gradient (Sum and Average, grouped forms, pre- and
    postscale) against autograd in one process under Horovod's definitions; a scalar
    reducescatter and an Adasum one raise Horovod's errors."""
    run_workers(n, "horovod_semantics.py", env={"PERSEUS_CHANGE_HVD_ALLGATHER": mode})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_adasum(run_workers, n):
    """allreduce(op=Adasum) against a NumPy reference of Horovod's rule (3: not a power of
    two, the last rank's tensor joins at the top)."""
    run_workers(n, "adasum.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", SIZES)
def test_adasum_optimizer(run_workers, n):
    """DistributedOptimizer(op=Adasum): local steps, weight changes combined by Adasum,
    against a replay of every rank's step (Adam, SGD over 2 passes, fp16, a process set
    on 3 ranks), and its refusals."""
    run_workers(n, "adasum_optimizer.py")


@pytest.mark.timeout(120)
def test_distributed_optimizer_with_a_compiled_model(run_workers):
    """torch.compile (AOTAutograd's compiled backward) leaves the gradient hooks to
    autograd: every gradient is reduced and the weights equal one process's training on
    the whole batch, plainly and with the overlapped step."""
    run_workers(2, "compiled.py")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", SIZES)
def test_training_while_layers_freeze_unfreeze_and_groups_are_added(run_workers, n):
    """Fine-tuning's changes to what trains (a layer unfrozen after the optimizer was
    wrapped, one frozen later, a group added by add_param_group) give what one process
    gets on the whole batch: plainly, with groups, over two passes, overlapped; Adasum
    names an added group."""
    run_workers(n, "freezing.py")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", SIZES)
def test_gradient_clipping_before_step_waits_for_the_reductions(run_workers, n):
    """torch's clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_ and get_total_norm
    between backward and step(), with no synchronize() first, clip the averaged gradients
    (one process's whole-batch training) instead of racing the reductions; step() then
    reduces nothing again."""
    run_workers(n, "clipping.py")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", SIZES)
def test_a_gradient_arriving_in_parts_after_its_reduction_started(run_workers, n):
    """A block run twice under reentrant checkpointing, and two backward() calls per step
    with backward_passes_per_step=1, give what one process gets on the whole batch (where
    Horovod asserts): plainly, with groups, fp16, two passes, op=Sum; the overlapped step
    refuses it naming the parameter."""
    run_workers(n, "rearrival.py")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", SIZES)
def test_training(run_workers, n):
    """DistributedOptimizer equals one process on the whole batch; SyncBatchNorm; sparse."""
    run_workers(n, "training.py", timeout=200)


@pytest.mark.timeout(240)
def test_dataloader_workers_of_a_script_that_inits_at_its_top_level(run_workers):
    """hvd.init() at a script's top level runs again in the DataLoader workers that
    spawn and forkserver start: there it joins nothing (it tried to join the job as the
    same rank, and the loader died after the start timeout). Each worker answers for
    its rank, refuses collectives saying why, and training equals one process."""
    run_workers(2, "loader_workers.py", "forkserver", "spawn", "fork", timeout=200)


@pytest.mark.timeout(150)
def test_a_spawned_process_that_reaches_init_during_its_ranks_init_waits_for_it(run_workers):
    run_workers(2, "spawn_during_init.py", timeout=120)


@pytest.mark.timeout(150)
def test_dataloader_workers_of_a_forkserver_started_before_init(run_workers):
    """The forkserver started before hvd.init() (the script used multiprocessing first):
    its workers inherit no mark in their environment, and find their rank through the
    file the rank keeps."""
    run_workers(2, "loader_workers.py", "forkserver", env={"EARLY_FORKSERVER": "1"},
                timeout=120)


@pytest.mark.timeout(120)
def test_a_thread_waiting_long_does_not_block_the_ones_starting_operations(run_workers):
    """A waiter's Ctrl-C check takes the GIL: it must not hold the engine's handle table
    while it does, or the thread starting operations (holding the GIL) stops with it."""
    run_workers(2, "threaded_wait.py", timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("marks", [False, True])
@pytest.mark.parametrize("ending", ["exit", "shutdown"])
def test_timeline_of_every_rank_streams_and_is_whole_after_the_job(run_workers, tmp_path,
                                                                   marks, ending):
    """One PERSEUS_TIMELINE path for all ranks: rank 0 writes it, rank r writes PATH.r.
    Each rank reads its file with json.load while the job runs (the file streams: whole
    JSON, the allreduce's NEGOTIATE_ALLREDUCE on row allreduce.at.exit), and both files are
    complete JSON after the job, whether the script called shutdown() or not. Horovod's
    layout: a pid per tensor named by process_name metadata, pid 0 the rank's header. With
    HOROVOD_TIMELINE_MARK_CYCLES=1 each rank's file also marks its negotiation cycles."""
    path = tmp_path / "timeline.json"
    env = {"PERSEUS_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": str(int(marks))}
    run_workers(2, "timeline_exit.py", *(["shutdown"] if ending == "shutdown" else []),
                env=env)
    for rank, file in enumerate((path, tmp_path / "timeline.json.1")):
        text = file.read_text()
        assert text.endswith("\n]\n"), text[-200:]
        events = json.loads(text)
        assert events[0]["pid"] == 0 and events[0]["args"]["rank"] == rank, events[0]
        names = {e["pid"]: e["args"]["name"] for e in events
                 if e["name"] == "process_name" and e["pid"] != 0}
        assert sorted(names.values()) == ["allreduce.at.exit"], names
        rows = {(names[e["pid"]], e["name"]) for e in events if e["ph"] == "X"}
        assert {("allreduce.at.exit", "NEGOTIATE_ALLREDUCE"),
                ("allreduce.at.exit", "ALLREDUCE")} <= rows, (file, rows)
        cycles = [e for e in events if e["name"] == "CYCLE_START"]
        if not marks:
            assert cycles == [], cycles
            continue
        assert cycles and all(e["ph"] == "i" and e["args"]["requests"] >= 1
                              for e in cycles), cycles
        # The cycle that sent the allreduce's request comes before its operation.
        op = next(e for e in events if e["ph"] == "X" and e["name"] == "ALLREDUCE")
        assert min(e["ts"] for e in cycles) <= op["ts"], (cycles, op)


@pytest.mark.timeout(60)
def test_import_aliases():
    import perseus.torch as hvd_short
    import perseus.torch.horovod as hvd

    for name in hvd.__all__:
        assert getattr(hvd_short, name) is getattr(hvd, name), name
    assert hvd.HorovodInternalError is hvd.PerseusInternalError
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
