"""The reduction of one step's gradients, shared by DistributedGradientTape and both
DistributedOptimizers, with the PERSEUS_* switches that act on gradients.

All dense gradients of a step go to the core together, from one graph op: one
py_function call per step, whatever the number of variables. The core fuses them
into buffers (PERSEUS_ALLREDUCE_FUSION sets the size from the gradients' bytes) and
sends float32 as PERSEUS_ALLREDUCE_DTYPE says. Here, in the eager body of that op:

- PERSEUS_DOWNSAMPLE_N_ELEMENTS / PERSEUS_GRADIENT_MOMENTUM: each gradient joins its
  residual and only every N-th element (rotating offset) is sent; the others wait.
- PERSEUS_ALLREDUCE_NANCHECK: a NaN or Inf in a reduced gradient raises
  ``FloatingPointError`` naming the variables and the ranks it came from.
- PERSEUS_PERF_CHECK_N_STEPS: every N steps the ranks compare their compute time
  between reductions; a rank slower than 1.5x the median says so.
"""

import time

import numpy as np
import tensorflow as tf

from perseus.common import elastic
from perseus.common.basics import config as _config
from perseus.common.basics import generation, set_fusion_threshold
from perseus.common.downsample import DownSampler
from perseus.common.gradients import (
    Switches,
    check_optimizer_args,
    perf_check,
    raise_nonfinite,
    scale_factors,
    warn_unapplied,
)
from perseus.common.ops import Adasum, Average, Sum, check_op
from perseus.common.process_sets import process_set_size
from perseus.tensorflow.horovod import bridge as _bridge
from perseus.tensorflow.horovod.mpi_ops import _sparse_allreduce, allreduce_now

_FLOATS = (np.float16, np.float32, np.float64)


def _var_name(v):
    return getattr(v, "path", None) or getattr(v, "name", None) or "var"


class GradientReducer:
    """Averages (or sums) a list of gradients across ``process_set``.

    ``prefix`` starts the names the reductions carry; ``variables`` (when known)
    give each gradient its variable's name, so the names stay the same every step.
    """

    def __init__(self, prefix, compression, op=Average, gradient_predivide_factor=1.0,
                 sparse_as_dense=False, process_set=None):
        from perseus.common.process_sets import global_process_set

        self.prefix = prefix
        self.compression = compression
        check_optimizer_args(op, gradient_predivide_factor, 0)
        self.op = check_op(op)
        if self.op not in (Average, Sum, Adasum):
            raise ValueError("gradients can be reduced with Average, Sum or Adasum only")
        self.predivide = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set if process_set is not None else global_process_set
        self.generation = generation()
        self._switches = Switches(_config())
        warn_unapplied("TensorFlow's DistributedOptimizer and DistributedGradientTape")
        self._nancheck = self._switches.nancheck
        self._downsample_n = self._switches.downsample_n
        self._sampler = DownSampler(self._downsample_n, self._switches.momentum, np.copy,
                                    lambda n, like: np.zeros(n, dtype=like.dtype))
        self._perf_every = self._switches.perf_every
        self._fusion_set = False
        self._updates = 0
        self._compute_times = []
        self._last_end = None

    # ------------------------------------------------------------------ graph level

    def reduce(self, grads, variables=None):
        """Reduced gradients, in the order given; ``None`` stays ``None``."""
        grads = list(grads)
        if (process_set_size(self.process_set) == 1 and self._downsample_n <= 1
                and not self._nancheck and self._perf_every == 0
                and (tf.executing_eagerly() or not elastic.enabled())):
            # The average over one rank: nothing to send, nothing to check. Not in a
            # graph of an elastic job: the graph outlives the round (Keras keeps its
            # traced step), and the job may grow.
            return grads
        names = [_var_name(v) for v in variables] if variables is not None else [
            str(i) for i in range(len(grads))]
        return self._reduce_graph(grads, names)

    def _reduce_graph(self, grads, names):
        out = list(grads)
        dense, dense_names, tensors = [], [], []
        for i, (g, name) in enumerate(zip(grads, names)):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                # Adasum combines whole tensors: sparse gradients go dense.
                if not self.sparse_as_dense and self.op != Adasum:
                    out[i] = _sparse_allreduce(g, f"{self.prefix}.{i}.{name}", self.op,
                                               self.process_set)
                    continue
                g = tf.convert_to_tensor(g)
            dense.append(i)
            dense_names.append(f"{self.prefix}.{i}.{name}")
            tensors.append(_bridge.as_tensor(g))
        if not dense:
            return out

        def body(*eager):
            return self._reduce_eager(list(eager), dense_names)

        reduced = _bridge.run(body, tensors, [t.dtype for t in tensors],
                              "PerseusGradientReduce")
        for i, r, t in zip(dense, reduced, tensors):
            r.set_shape(t.shape)
            out[i] = r
        return out

    # ------------------------------------------------------------------ eager body

    def _scale_factors(self):
        return scale_factors(self.op, self.predivide)

    def _reduce_eager(self, grads, names):
        entered = time.perf_counter()
        if self._perf_every > 0 and self._last_end is not None:
            self._compute_times.append(entered - self._last_end)
        if self._switches.fusion is not None and not self._fusion_set:
            total = sum(int(np.prod(g.shape)) * g.dtype.size for g in grads)
            set_fusion_threshold(self._switches.fusion_threshold(total))
            self._fusion_set = True
        own_bad = []
        sends, contexts = [], []
        for g, name in zip(grads, names):
            if self._nancheck and g.dtype.is_floating and not _finite(g):
                own_bad.append(name)
            sent, sampled = self._downsample(name, g)
            compressed, ctx = self.compression.compress(sent)
            sends.append(compressed)
            contexts.append((ctx, sampled))
        pre, post = self._scale_factors()
        outputs = allreduce_now(sends, names, self.op, pre, post, self.process_set,
                                gradient=True)
        results = [self._restore(g, out, ctx, sampled)
                   for g, out, (ctx, sampled) in zip(grads, outputs, contexts)]
        self._updates += 1
        if self._nancheck:
            self._check_finite(results, names, own_bad)
        if self._perf_every > 0:
            if len(self._compute_times) >= self._perf_every:
                times, self._compute_times = self._compute_times, []
                perf_check(times, self._perf_every, self.prefix, self.process_set)
            self._last_end = time.perf_counter()
        return results

    def _downsample(self, name, g):
        """PERSEUS_DOWNSAMPLE_N_ELEMENTS=N (:mod:`perseus.common.downsample`): the slice to
        send at this update and its ``Sampled``; an integer gradient, or N of 1, goes as
        it is (None)."""
        if self._downsample_n <= 1 or g.dtype.as_numpy_dtype not in _FLOATS:
            return g, None
        sent, sampled = self._sampler.send(name, g.numpy().reshape(-1), self._updates)
        return tf.constant(sent), sampled

    def _restore(self, g, output, ctx, sampled):
        reduced = self.compression.decompress(output, ctx)
        if sampled is None:
            return reduced
        full = np.empty(int(np.prod(g.shape)), dtype=g.dtype.as_numpy_dtype)
        DownSampler.restore(full, reduced.numpy(), sampled)
        return tf.constant(full.reshape(g.shape))

    def _check_finite(self, results, names, own_bad):
        bad = [n for r, n in zip(results, names) if r.dtype.is_floating and not _finite(r)]
        if bad:
            raise_nonfinite(bad, own_bad, self.prefix, self.process_set)


def _finite(t):
    return bool(tf.reduce_all(tf.math.is_finite(tf.cast(t, tf.float32)
                                                if t.dtype == tf.bfloat16 else t)))


def set_size_scale(process_set):
    """1 / the set's size: how Horovod scales the gradients of local (unreduced) sources."""
    return 1.0 / process_set_size(process_set)


class LocalVariables:
    """The variables whose gradients stay on their rank (Horovod's local sources/vars).

    Held by identity, with a reference, so a registered variable's id is never reused.
    """

    def __init__(self):
        self._vars = {}

    def add(self, var, what):
        """Register ``var``; ``what`` names the caller in the error for a non-variable."""
        if var is None or isinstance(var, (tf.Tensor, tf.IndexedSlices)) or not hasattr(
                var, "assign"):
            raise TypeError(f"{what} takes a variable (tf.Variable or keras.Variable), got "
                            f"{type(var).__name__}")
        self._vars[id(var)] = var

    def __contains__(self, var):
        return id(var) in self._vars

    def __len__(self):
        return len(self._vars)


def reduce_except_local(reducer, grads, variables, local, scale_local):
    """``reducer.reduce`` of the gradients of the variables not in ``local``; the local
    ones stay as they are, multiplied by 1 / the set's size when ``scale_local`` (as
    Horovod does, so that a learning rate scaled by the size suits them too).

    ``variables`` (one per gradient) may be None when ``local`` is empty.
    """
    grads = list(grads)
    if not local:
        return reducer.reduce(grads, variables)
    variables = list(variables)
    shared = [i for i, v in enumerate(variables) if v not in local]
    reduced = reducer.reduce([grads[i] for i in shared], [variables[i] for i in shared])
    out = list(grads)
    for i, r in zip(shared, reduced):
        out[i] = r
    if scale_local:
        scale = set_size_scale(reducer.process_set)
        if not tf.executing_eagerly() and elastic.enabled():
            # A traced step outlives the round (Keras keeps it): the size of the set
            # when the step runs, not when it was traced.
            ps = reducer.process_set
            scale = tf.numpy_function(lambda: np.float64(set_size_scale(ps)), [],
                                      tf.float64, stateful=True)
        for i, v in enumerate(variables):
            if v in local and out[i] is not None:
                g = out[i]
                if isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype),
                                              g.indices, g.dense_shape)
                else:
                    out[i] = g * tf.cast(scale, g.dtype)
    return out
