"""What Keras does differently for models that train with a Perseus optimizer.

:func:`install` (done by the first Keras ``DistributedOptimizer``) makes these changes,
each only where a Perseus optimizer reduces the gradients; everything else is Keras' own.

- **No XLA.** Keras compiles a model's training step with XLA when ``jit_compile`` is
  true. Keras 3's ``compile()`` default, ``jit_compile="auto"``, means true on every
  machine with a GPU; Keras 2 (tf_keras) uses XLA when asked to. Code compiled by XLA
  cannot call Python, so it cannot reach the Perseus core, and the step would fail to
  compile. ``Model.compile`` turns ``jit_compile`` off for a model whose optimizer is a
  Perseus one, as Keras itself does for layers XLA cannot compile: silently for
  ``"auto"``, with a warning when ``jit_compile=True`` was asked for.
- **Loss scaling decided alike on every rank** (Keras 3). Under a ``mixed_float16``
  policy Keras wraps the optimizer in a ``LossScaleOptimizer``, which skips a step and
  halves its loss scale when the gradients hold an inf or a NaN. Keras 3's checks the
  gradients it is given, which for a Perseus optimizer are the rank's own (they are
  reduced inside the wrapped optimizer's ``apply``): a rank whose gradients overflowed
  would skip the step, and its reduction, while the others reduce. ``check_finite`` of
  a LossScaleOptimizer that wraps a Perseus optimizer therefore takes the minimum of the
  ranks' answers (one scalar allreduce a step): every rank skips, or none does. Keras
  2's LossScaleOptimizer needs no change: it has the wrapped optimizer aggregate (here:
  reduce) the gradients before it checks them, so an overflow on one rank makes the
  reduced gradients non-finite on every rank.

``compile()`` also drops ``experimental_run_tf_function``, whatever the model: Horovod's
TF2 Keras examples pass it (``False``), and Keras 3, which has no counterpart of what it
meant in TensorFlow 2.0 - 2.1, would reject it (Keras 2 ignores it).
"""

import functools
import inspect
import warnings

import tensorflow as tf

from perseus.common.ops import Min
from perseus.tensorflow.horovod.mpi_ops import allreduce
from perseus.tensorflow.keras_module import KERAS3, keras

_installed = False


def reduces_with_perseus(optimizer):
    """Whether ``optimizer`` (or the optimizer a LossScaleOptimizer wraps) is a Perseus
    distributed optimizer."""
    inner = getattr(optimizer, "inner_optimizer", None)
    # (The class attribute of perseus.tensorflow.horovod.keras_optimizer's mixin.)
    return any(getattr(o, "_perseus_distributed", False) for o in (optimizer, inner))


def without_xla(model, asked="auto"):
    """Turns XLA off for a compiled ``model`` whose optimizer is a Perseus one, with a
    warning when ``asked`` (the ``jit_compile`` its ``compile()`` was given) is True."""
    if not (model.jit_compile and reduces_with_perseus(getattr(model, "optimizer", None))):
        return
    if asked is True:
        warnings.warn("perseus: code compiled by XLA cannot call the Perseus core, which "
                      "reduces this model's gradients; proceeding with jit_compile=False",
                      stacklevel=3)
    model.jit_compile = False


def _compile_without_xla(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        # Horovod's TF2 examples pass it; Keras 3 has no such argument (nor its meaning).
        kwargs.pop("experimental_run_tf_function", None)
        asked = signature.bind(self, *args, **kwargs).arguments.get("jit_compile", "auto")
        result = original(self, *args, **kwargs)
        without_xla(self, asked)
        return result
    return compile


def _finite_on_every_rank(original):
    @functools.wraps(original)
    def check_finite(self, grads):
        finite = original(self, grads)
        inner = getattr(self, "inner_optimizer", None)
        if not reduces_with_perseus(inner):
            return finite
        everywhere = allreduce(tf.cast(finite, tf.int32), op=Min,
                               name="perseus.LossScaleOptimizer.finite",
                               process_set=inner._perseus_reducer.process_set)
        return tf.cast(everywhere, tf.bool)
    return check_finite


def install():
    """Make both changes (see the module's docstring), once."""
    global _installed
    if _installed:
        return
    # Patched where Keras defines it (Keras 3: its trainer base class), not on a
    # subclass: Keras takes a compile() that differs from its own for a model's custom
    # one, and then does not compile models it loads.
    owner = next(c for c in keras.Model.__mro__ if "compile" in vars(c))
    owner.compile = _compile_without_xla(owner.compile)
    if KERAS3:
        scaler = keras.mixed_precision.LossScaleOptimizer
        scaler.check_finite = _finite_on_every_rank(scaler.check_finite)
    _installed = True
