"""What every front-end's DistributedOptimizer shares, framework-neutral: argument checks,
the PERSEUS_ALLREDUCE_NANCHECK report and the PERSEUS_PERF_CHECK_N_STEPS comparison."""

import socket
import statistics
import warnings

from perseus import _core
from perseus.common import knobs
from perseus.common.basics import config, local_rank
from perseus.common.objects import allgather_object
from perseus.common.ops import Average

# Seed 000's accelerations that only torch's hvd.DistributedOptimizer applies:
# (variable, its perseusrun flag).
_TORCH_OPTIMIZER_ONLY = (("PERSEUS_DGC", "--dgc"),
                         ("PERSEUS_OVERLAP_BACKWARD_AND_STEP", "--overlap-backward-and-step"))
_FUSED = ("PERSEUS_FUSED_OPTIMIZER", "--fuse-optimizer")


def fused_optimizer_wanted(environ=None):
    """Whether the environment asks for the fused optimizer step: PERSEUS_FUSED_OPTIMIZER,
    else its alias, seed 001's AIAK_FUSED_OPTIMIZER (before any init; a value the core
    would refuse at init counts as no)."""
    try:
        return knobs.get("PERSEUS_FUSED_OPTIMIZER", environ)
    except ValueError:
        return False


_warned_unapplied = set()


def warn_unapplied(where, fused_applies=False, environ=None):
    """Warn, once per process and setting, about seed 000's accelerations that are set
    but that ``where`` (e.g. "TensorFlow's DistributedOptimizer") does not apply: DGC and
    the overlapped step (torch's hvd.DistributedOptimizer only), and the fused optimizer
    unless ``fused_applies``. Returns the variables warned about."""
    wanted = list(_TORCH_OPTIMIZER_ONLY) + ([] if fused_applies else [_FUSED])
    said = []
    for var, flag in wanted:
        on = (fused_optimizer_wanted(environ) if var == _FUSED[0]
              else knobs.get(var, environ))
        if not on or (where, var) in _warned_unapplied:
            continue
        _warned_unapplied.add((where, var))
        said.append(var)
        warnings.warn(f"{var}=1 ({flag}) acts on torch's hvd.DistributedOptimizer only: "
                      f"{where} trains without it", RuntimeWarning, stacklevel=3)
    return said


def check_optimizer_args(op, gradient_predivide_factor, num_groups, stacklevel=3):
    """Horovod's checks of a DistributedOptimizer's reduction arguments."""
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.",
                      DeprecationWarning, stacklevel=stacklevel)


class Switches:
    """The PERSEUS_* gradient switches every front-end's DistributedOptimizer honours
    (docs/environment.md), read once from the engine's configuration ``cfg`` (the core
    checked them at init; the table of settings gives their kinds and defaults)."""

    def __init__(self, cfg):
        self.accumulate = knobs.get("PERSEUS_ACCUMULATE_N_STEPS", cfg)
        self.nancheck = knobs.get("PERSEUS_ALLREDUCE_NANCHECK", cfg)
        self.downsample_n = knobs.get("PERSEUS_DOWNSAMPLE_N_ELEMENTS", cfg)
        self.momentum = knobs.get("PERSEUS_GRADIENT_MOMENTUM", cfg)
        self.perf_every = knobs.get("PERSEUS_PERF_CHECK_N_STEPS", cfg)
        self.fusion = knobs.get("PERSEUS_ALLREDUCE_FUSION", cfg)  # None: unset
        self.fused_optimizer = knobs.get("PERSEUS_FUSED_OPTIMIZER", cfg)

    def set_on_gradients(self):
        """The switches set here that act on the gradients themselves (accumulation,
        the NaN check, down-sampling, the perf check), by variable."""
        return [var for var, on in (
            ("PERSEUS_ACCUMULATE_N_STEPS", self.accumulate > 1),
            ("PERSEUS_ALLREDUCE_NANCHECK", self.nancheck),
            ("PERSEUS_DOWNSAMPLE_N_ELEMENTS", self.downsample_n > 1),
            ("PERSEUS_PERF_CHECK_N_STEPS", self.perf_every > 0),
        ) if on]

    def fusion_threshold(self, gradient_bytes):
        """PERSEUS_ALLREDUCE_FUSION=N: the fusion threshold that cuts ``gradient_bytes``
        of gradients into N buffers (0: no fusion); None when the variable is unset."""
        if self.fusion is None:
            return None
        return 0 if self.fusion == 0 else -(-gradient_bytes // self.fusion)


def warn_adasum_unapplied(stacklevel=3, cfg=None):
    """Warn about the PERSEUS_* gradient switches that are set (in ``cfg``, default the
    engine's configuration) but act on gradient allreduces, which a
    DistributedOptimizer(op=Adasum) does not make (it reduces weight changes). Returns the
    variables warned about."""
    unapplied = Switches(config() if cfg is None else cfg).set_on_gradients()
    if unapplied:
        warnings.warn(f"{', '.join(unapplied)} act on gradient allreduces: "
                      "DistributedOptimizer(op=Adasum) reduces weight changes and trains "
                      "without them", RuntimeWarning, stacklevel=stacklevel)
    return unapplied


def scale_factors(op, gradient_predivide_factor, local=1.0):
    """(prescale, postscale) of a gradient allreduce. ``local`` multiplies the gradient
    first (1/N for N accumulated steps). An Average splits its division: by
    ``gradient_predivide_factor`` before the sum, the rest after it (the core divides
    by the set size after the postscale, which undoes the predivision)."""
    if op == Average:
        return local / gradient_predivide_factor, gradient_predivide_factor
    return local, 1.0


def raise_nonfinite(bad, own_bad, name, process_set):
    """PERSEUS_ALLREDUCE_NANCHECK found NaN or Inf in the reduced gradients ``bad`` (names).

    Every rank holds the same reduced gradients, so every rank gets here together; the
    ranks' own findings (``own_bad``: names whose local gradient was not finite) say
    where it came from. Raises ``FloatingPointError`` on every rank.
    """
    found = allgather_object(own_bad, name=f"{name}.nancheck", process_set=process_set)
    origins = [f"rank {r} ({', '.join(names)})" for r, names in enumerate(found) if names]
    where = ("it came from " + "; ".join(origins) if origins else
             "no rank's own gradient had one: it arose in the sum (overflow)")
    raise FloatingPointError(
        f"PERSEUS_ALLREDUCE_NANCHECK: NaN or Inf in the reduced gradient of "
        f"{', '.join(bad)}; {where}. The update was not applied.")


def perf_check(compute_times, every, name, process_set):
    """PERSEUS_PERF_CHECK_N_STEPS: the ranks share their mean compute time per step over
    the last ``every`` steps; a rank slower than 1.5x the median says so on its own host,
    with the figures."""
    mine = statistics.fmean(compute_times)
    times = allgather_object(mine, name=f"{name}.perf_check", process_set=process_set)
    median = statistics.median_low(times)
    if mine > 1.5 * median and mine - median > 1e-3:
        host = knobs.text("PERSEUS_HOSTNAME") or socket.gethostname()
        _core.log("WARNING", f"PERSEUS_PERF_CHECK_N_STEPS: this rank (host {host}, "
                  f"local rank {local_rank()}) computed "
                  f"{mine * 1e3:.1f} ms per step over the last {every} steps, "
                  f"{mine / median:.1f}x the median rank's {median * 1e3:.1f} ms; every "
                  f"rank waits for it. Check this machine's load, clocks and devices.")
