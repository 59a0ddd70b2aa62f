"""Assertions shared by the worker scripts (each worker exits non-zero on failure).

``raises`` and ``done`` serve the TensorFlow workers too, so torch is imported only by
the torch helpers."""

import contextlib
import os
import sys

OK_MARK = "WORKER OK"


def close(actual, expected, what, rtol=None, atol=None):
    """Assert tensors are equal (or close for floats), with dtype and shape."""
    import torch

    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=False)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}\nactual={actual}\nexpected={expected}") from None


def tol(dtype):
    """(rtol, atol) suited to a dtype's precision."""
    import torch

    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    if dtype == torch.float32:
        return 1e-5, 1e-5
    if dtype == torch.float64:
        return 1e-10, 1e-10
    return 0, 0


@contextlib.contextmanager
def raises(exc_type, *fragments, what=""):
    """Assert the block raises ``exc_type`` whose message contains every fragment."""
    try:
        yield
    except exc_type as e:
        msg = str(e)
        for f in fragments:
            assert f in msg, f"{what}: expected {f!r} in the error message, got: {msg}"
    else:
        raise AssertionError(f"{what}: expected {exc_type.__name__}, nothing was raised")


def direct_reads():
    """Whether this job's ranks of one host read large blocks from one another's memory
    (PERSEUS_SHM on, PERSEUS_SHM_DIRECT=1, and Yama letting unrelated processes read;
    with PERSEUS_SHM_DIRECT unset, a check at init decides, unknown here)."""
    if os.environ.get("PERSEUS_SHM", "1") != "1" or \
            os.environ.get("PERSEUS_SHM_DIRECT") != "1":
        return False
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True


def done(rank):
    """Report success (the test counts these marks)."""
    print(f"{OK_MARK} rank {rank}", flush=True)
    sys.stdout.flush()


def close_array(actual, expected, what, rtol=1e-6, atol=1e-6):
    """Assert values (anything numpy can take, or with ``.numpy()``/``.asnumpy()``) are
    equal within tolerance, shapes included: the TensorFlow and MXNet workers' check."""
    import numpy as np

    def arr(x):
        for method in ("numpy", "asnumpy"):
            if hasattr(x, method):
                return np.asarray(getattr(x, method)())
        return np.asarray(x)

    a, e = arr(actual), arr(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != expected {e.shape}\n{a}\n{e}")
    np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol,
                               atol=atol, err_msg=what)


def regression_batch(n, rows):
    """The whole batch of a data-parallel equivalence test: ``rows`` samples per rank of
    ``n``, 5 features and a linear target (numpy float32, the same on every rank)."""
    import numpy as np

    rng = np.random.RandomState(0)
    x = rng.randn(rows * n, 5).astype(np.float32)
    return x, (x @ rng.randn(5, 1) + 0.1).astype(np.float32)


def count_fused_steps():
    """From now on, record the optimizer of every fused step perseus.torch.optim takes;
    returns the list they are appended to."""
    import perseus.torch.optim as fused

    calls = []
    run_step = fused.run_step

    def counting_run_step(*args, **kwargs):
        calls.append(args[0])
        return run_step(*args, **kwargs)

    fused.run_step = counting_run_step
    return calls


def torch_own_step(opt):
    """torch's own step of ``opt``, also where PERSEUS_FUSED_OPTIMIZER=1 made its class's
    step the core's fused one (perseus.aiak): references must not take the fused step."""
    import inspect

    import torch

    with torch.no_grad():
        inspect.unwrap(type(opt).step)(opt)


def small_mlp():
    """The workers' small regression model, seeded alike on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def whole_batch_training(n, rows, steps, make_opt, skipped=(), max_norm=None):
    """The weights of :func:`small_mlp` after one process trains ``steps`` steps on the
    whole batch of :func:`step_batch` (mean squared error), with ``make_opt(params)``'s
    optimizer: what data-parallel training on ``n`` ranks of ``rows`` rows must give. The
    steps in ``skipped`` compute gradients but do not step; with ``max_norm`` the
    gradients are clipped to that norm first."""
    import torch
    import torch.nn.functional as F

    net = small_mlp()
    opt = make_opt(net.parameters())
    for step in range(steps):
        x, y = step_batch(n, rows, step)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        if step in skipped:
            continue
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()
    return [p.detach() for p in net.parameters()]


def step_batch(n, rows, step):
    """Step ``step``'s whole batch for ``n`` ranks of ``rows`` rows each, alike on every
    rank: inputs of 6 features, targets of 3."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n * rows, 6, generator=g), torch.randn(n * rows, 3, generator=g)


def timeline_rows(events):
    """A timeline's spans by row (Horovod's layout: a ``pid`` per tensor, named by its
    ``process_name`` metadata): ``{row name: {phase: (start, end)}}`` in microseconds, the
    last span of each phase."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name" and "name" in e["args"]}
    rows = {}
    for e in events:
        if e["ph"] == "X":
            rows.setdefault(names[e["pid"]], {})[e["name"]] = (e["ts"], e["ts"] + e["dur"])
    return rows


def read_timeline_while_running(path, row, phase, timeout=10.0):
    """Reads the timeline ``path`` with ``json.load`` while the job runs, until its row
    ``row`` holds a ``phase`` span (events reach the file within 0.1 s); returns the
    events. A read that meets a write half done is tried again; the file must parse in
    the end."""
    import json
    import time

    deadline = time.monotonic() + timeout
    why = "no such file"
    while True:
        try:
            with open(path) as f:
                events = json.load(f)
            rows = timeline_rows(events)
            if phase in rows.get(row, {}):
                return events
            why = f"rows so far: {rows}"
        except (OSError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} had no {phase} on row {row} within {timeout} s "
                                 f"while the job ran ({why})")
        time.sleep(0.02)
