"""PyTorch DistributedDataParallel on the Perseus core (docs/torch_distributed.md).

``import perseus`` (seed 003 asks for it before ``import torch``; after works too)
and every ``DistributedDataParallel`` model, on torch's default process group or on
a subgroup (``new_group``, ``new_subgroups``, ``split_group``, a ``DeviceMesh``
dimension: each is reduced by a Perseus process set of the same ranks, which the
group's ranks register among themselves), has its gradient buckets
averaged by Perseus instead of by the group's backend:
the model, the optimizer, the launcher and the rest of torch.distributed stay as
they are. A model on which the user registers a communication hook (before its
first forward) keeps that hook. ``PERSEUS_DDP=0`` leaves DDP's communication to torch;
seed 001's ``AIAK_POWERSGD_COMPRESSION=1`` compresses the buckets (perseus.torch.powersgd).

Perseus finds its ranks as it does for the Horovod API (torchrun's ``RANK`` and
``WORLD_SIZE``, perseusrun, mpirun, srun). A job whose processes were given their
ranks only through ``init_process_group(rank=..., world_size=...)`` (as
``torch.multiprocessing.spawn`` scripts do) takes them from torch's group: the
ranks meet through torch's store, and rank 0 hosts Perseus's rendezvous on a free
port. Under perseusrun, mpirun or srun, an ``init_process_group()`` that finds
none of torch's variables gets them from Perseus.
"""

import inspect
import itertools
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from perseus.common import knobs
from perseus.common.downsample import DownSampler
from perseus.torch import ddp_switches, startup
from perseus.torch.completion import completed

__all__ = ["allreduce_hook", "completed", "enabled", "hooked", "init", "patch",
           "process_set_of"]

# Variables by which Perseus's core finds its ranks without torch (config/topology.rs).
_originals = {}
_ids = itertools.count()


def enabled():
    """Whether DDP models reduce through Perseus: ``PERSEUS_DDP`` (1, the default, or 0)."""
    return knobs.get("PERSEUS_DDP")


def init():
    """Start Perseus for the ranks of torch's default process group (collective: every
    rank calls it; it does nothing once Perseus runs). Building a DDP model calls it;
    call it yourself before registering :func:`allreduce_hook` by hand with
    ``PERSEUS_DDP=0``. Raises ``ValueError`` when Perseus and torch disagree on the
    ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: call "
                         "torch.distributed.init_process_group() before perseus.ddp.init()")
    startup.start(dist.get_rank(), dist.get_world_size(), startup.default_store())


def _init_process_group(*args, **kwargs):
    from perseus.torch import backend

    if args:
        args = (backend.serving(args[0]), *args[1:])
    else:
        kwargs["backend"] = backend.serving(kwargs.get("backend"))
    if startup.torch_env_missing(args, kwargs):
        startup.torch_env_from_perseus()
    return _originals["init_process_group"](*args, **kwargs)


# --------------------------------------------------------------------------- subgroups

def process_set_of(group):
    """The Perseus process set that reduces for torch process group ``group`` (``None``:
    the default group). The first call for a subgroup registers a set of its ranks:
    a collective over those ranks alone (each calls it, as building a DDP model on the
    group does; the other ranks take no part), so any group works, however torch made
    it (``new_group``, ``use_local_synchronization=True``, ``split_group``, a
    ``DeviceMesh`` dimension). A set of the same ranks registered already, with
    ``hvd.add_process_set`` or by an earlier group, is reused. Perseus must be running
    (see :func:`init`)."""
    from perseus.torch.horovod import mpi_ops

    default = dist.distributed_c10d._get_default_group()
    if group is None or group is default:
        return mpi_ops.global_process_set
    ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    if len(ranks) == dist.get_world_size():
        return mpi_ops.global_process_set
    if dist.get_rank() not in ranks:
        raise ValueError(f"rank {dist.get_rank()} is not in the process group of ranks "
                         f"{list(ranks)}, so it has no process set there")
    return startup.set_of_ranks(ranks)


# --------------------------------------------------------------------------- the hook

class _State:
    """Perseus's side of one DDP model: its tensors' name prefix, the hook choice, and
    PowerSGD's state when seed 001's AIAK_POWERSGD_COMPRESSION=1 asks for it."""

    __slots__ = ("group", "hooked", "powersgd", "prefix", "process_set", "settled",
                 "switches", "user_hook")

    def __init__(self, prefix, group, user_hook, powersgd=None, switches=None):
        self.prefix = prefix
        self.group = group  # torch's process group of the model
        self.user_hook = user_hook
        self.powersgd = powersgd
        self.switches = switches  # a ddp_switches.BucketSwitches, or None
        self.process_set = None  # the group's, found at the first need
        self.settled = False  # the first forward chose the hook
        self.hooked = False  # Perseus's hook is the model's

    def __repr__(self):
        return f"<perseus DDP state {self.prefix}>"


def allreduce_hook(state, bucket):
    """DDP communication hook: average ``bucket``'s gradients over the model's ranks with
    Perseus.

    The reduction is a gradient one, so PERSEUS_ALLREDUCE_DTYPE, its gradient scale
    and PERSEUS_ALLREDUCE_MODE apply as for ``DistributedOptimizer``; on the models
    Perseus hooks itself, the other gradient switches too (perseus.torch.ddp_switches).
    ``state`` may be
    ``None`` (every rank) or a torch process group (its ranks), as for torch's own
    ``allreduce_hook``: ``ddp.register_comm_hook(group, perseus.ddp.allreduce_hook)``;
    every rank of the group must register it on the same models in the same order.
    Perseus must be running (see :func:`init`).
    """
    switches = state.switches if isinstance(state, _State) else None
    if switches is not None:
        held = _accumulate(state, switches, bucket)
        if held is not None:
            return held
    return _average(state, bucket, switches)


def _accumulate(state, switches, bucket):
    """Starts the bucket's step for the switches; under PERSEUS_ACCUMULATE_N_STEPS, the
    done future of a bucket kept local inside a window, else None (the bucket now holds
    the window's average, to be reduced)."""
    switches.begin(bucket, _process_set(state))
    if switches.hold(bucket):
        return _done(bucket.buffer())
    switches.release(bucket)
    return None


def _average(state, bucket, switches):
    """Averages the bucket over the model's ranks (down-sampled and checked as the
    switches say) and returns the future DDP waits on."""
    from perseus.torch.horovod import mpi_ops

    buf, prefix, process_set = bucket.buffer(), _prefix(state), _process_set(state)
    own, sent, sampled = None, buf, None
    if switches is not None:
        own = switches.own_flags(bucket)
        sent, sampled = switches.sample(bucket)
    handle = mpi_ops.gradient_allreduce_async_(
        sent, f"{prefix}.bucket{bucket.index()}", mpi_ops.Average, 1.0, 1.0, process_set)

    def finish():
        handle.wait()
        if sampled is not None:
            DownSampler.restore(buf, sent, sampled)
        if switches is not None:
            switches.reduced(bucket, own, prefix, process_set)
        return buf

    return completed(buf, finish)


def _done(buf):
    """The future of a bucket kept local (an accumulation window's inner step)."""
    future = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
    future.set_result(buf)
    return future


def _prefix(state):
    if not startup.core().is_initialized():
        raise ValueError("Perseus is not initialized: call perseus.ddp.init() after "
                         "init_process_group() and before the first backward")
    if isinstance(state, _State):
        return state.prefix
    if isinstance(state, dist.ProcessGroup):
        return f"ddp.group{'.'.join(map(str, sorted(dist.get_process_group_ranks(state))))}"
    return "ddp"


def _process_set(state):
    """The process set a hook's ``state`` reduces over (see :func:`allreduce_hook`)."""
    from perseus.torch.horovod import mpi_ops

    if isinstance(state, _State):
        ps = state.process_set
        if ps is None or ps.process_set_id is None:  # or Perseus restarted since
            ps = state.process_set = process_set_of(state.group)
        return ps
    if isinstance(state, dist.ProcessGroup):
        return process_set_of(state)
    return mpi_ops.global_process_set


# --------------------------------------------------------------------------- DDP

def _why_not(ddp):
    """Why this model keeps torch's communication, or None."""
    if getattr(ddp, "_use_python_reducer", False):
        return "compiled autograd reduces through torch's functional collectives"
    if getattr(ddp, "_delay_all_reduce_all_params", False):
        return "it delays every allreduce to the end of backward"
    device = getattr(ddp, "device_type", "cpu")
    if device not in ("cpu", "cuda"):
        return f"its parameters are on {device}"
    if device == "cuda":
        from perseus.common import gpu

        if not gpu.built():
            return "this build of Perseus has no GPU support"
    return None


def _attach(ddp):
    if not enabled():
        return
    reason = _why_not(ddp)
    if reason is not None:
        warnings.warn(f"perseus: this DistributedDataParallel keeps torch's allreduce: {reason}",
                      RuntimeWarning, stacklevel=3)
        return
    from perseus.common.basics import set_fusion_threshold
    from perseus.common.gradients import warn_unapplied
    from perseus.torch import powersgd

    warn_unapplied("DistributedDataParallel", fused_applies=True)
    on, rank, start = powersgd.settings()
    init()
    threshold = ddp_switches.fusion_threshold(ddp.module)
    if threshold is not None:
        set_fusion_threshold(threshold)
    ddp._perseus = _State(f"ddp{next(_ids)}", ddp.process_group,
                          user_hook=bool(getattr(ddp, "_comm_hooks", ())),
                          powersgd=powersgd.PowerSGD(rank, start) if on else None,
                          switches=ddp_switches.BucketSwitches.of(ddp.module, on))
    # Registers the group's set now, while every rank of the group builds the model.
    _process_set(ddp._perseus)


def _powersgd_hook(state, bucket):
    """DDP communication hook: PowerSGD on Perseus (``state.powersgd``), plain averaging
    before ``AIAK_START_COMPRESS_ITER``."""
    from perseus.torch import powersgd

    switches = state.switches
    own = None
    if switches is not None:
        held = _accumulate(state, switches, bucket)
        if held is not None:
            return held
        own = switches.own_flags(bucket)
    prefix, process_set = _prefix(state), _process_set(state)
    work = powersgd.reduce(state.powersgd, bucket, prefix, process_set)
    if work is None:
        return _average(state, bucket, switches)
    buf, reduce = work
    if switches is None:
        return completed(buf, reduce)

    def finish():
        reduce()
        switches.reduced(bucket, own, prefix, process_set)
        return buf

    return completed(buf, finish)


def hooked(ddp):
    """True when Perseus reduces ``ddp``'s gradients (decided at its first forward)."""
    state = ddp.__dict__.get("_perseus")
    return state is not None and state.hooked


def _ddp_init(self, *args, **kwargs):
    if enabled():
        bound = inspect.signature(_originals["ddp_init"]).bind(self, *args, **kwargs)
        mb = ddp_switches.bucket_cap_mb(bound.arguments["module"],
                                        bound.arguments.get("bucket_cap_mb"))
        if mb is not None:
            bound.arguments["bucket_cap_mb"] = mb
            args, kwargs = bound.args[1:], bound.kwargs
    _originals["ddp_init"](self, *args, **kwargs)
    _attach(self)


def _ddp_forward(self, *inputs, **kwargs):
    state = self.__dict__.get("_perseus")
    if state is not None and not state.settled:
        state.settled = True
        unapplied = ddp_switches.unapplied_with_own_hook() if state.user_hook else ()
        if unapplied:
            warnings.warn(f"{', '.join(unapplied)} act on Perseus's DDP hook: this "
                          "DistributedDataParallel keeps its own communication hook and "
                          "trains without them", RuntimeWarning, stacklevel=2)
        if not state.user_hook:
            hook = allreduce_hook if state.powersgd is None else _powersgd_hook
            _originals["register_comm_hook"](self, state, hook)
            state.hooked = True
    return _originals["ddp_forward"](self, *inputs, **kwargs)


def _user_hook(self):
    state = self.__dict__.get("_perseus")
    if state is None:
        return
    if state.hooked:
        raise RuntimeError(
            "Perseus registered its allreduce hook on this DistributedDataParallel at its "
            "first forward, and DDP takes one hook: register yours before the first "
            "forward, or set PERSEUS_DDP=0")
    state.user_hook = True


def _register_comm_hook(self, state, hook):
    _user_hook(self)
    return _originals["register_comm_hook"](self, state, hook)


def _register_builtin_comm_hook(self, comm_hook_type):
    _user_hook(self)
    return _originals["register_builtin_comm_hook"](self, comm_hook_type)


def patch():
    """Route DistributedDataParallel through Perseus (``import perseus`` calls this;
    idempotent). Models are checked against ``PERSEUS_DDP`` when they are built."""
    if _originals or not dist.is_available():
        return
    cls = DistributedDataParallel
    c10d = dist.distributed_c10d
    _originals.update(
        ddp_init=cls.__init__, ddp_forward=cls.forward,
        register_comm_hook=cls.register_comm_hook,
        register_builtin_comm_hook=cls._register_builtin_comm_hook,
        init_process_group=dist.init_process_group)
    for name, fn in (("__init__", _ddp_init), ("forward", _ddp_forward),
                     ("register_comm_hook", _register_comm_hook),
                     ("_register_builtin_comm_hook", _register_builtin_comm_hook)):
        fn.__wrapped__ = getattr(cls, name)
        fn.__doc__ = getattr(cls, name).__doc__
        setattr(cls, name, fn)
    _init_process_group.__wrapped__ = dist.init_process_group
    _init_process_group.__doc__ = dist.init_process_group.__doc__
    dist.init_process_group = _init_process_group
    c10d.init_process_group = _init_process_group
