"""The Keras that ``tf.keras`` is, chosen in this one place for every Keras part of
``perseus.tensorflow`` (as Horovod 0.28's ``horovod.tensorflow.keras`` is written against
``tf.keras``):

- Keras 3 (the ``keras`` package; TensorFlow 2.16 and later by default), or
- Keras 2: the ``tf_keras`` package when ``TF_USE_LEGACY_KERAS=1`` (``true``, ``True``),
  or a ``keras`` 2.x package (TensorFlow 2.15 and earlier).

TensorFlow decides it when ``tf.keras`` is first used (from ``TF_USE_LEGACY_KERAS`` at
that moment); this module asks ``tf.keras`` itself, so the two always agree. Importing it
imports that Keras.

``keras``: the package (``keras`` or ``tf_keras``, whose public API is ``tf.keras``'s);
``KERAS3``: whether it is Keras 3.
"""

import importlib

import tensorflow as tf


def _tf_keras_package():
    # tf.keras is TensorFlow's lazy loader of keras._tf_keras.keras (Keras 3),
    # tf_keras.api._v2.keras or keras.api._v2.keras (Keras 2): the package its classes
    # come from.
    root = tf.keras.layers.Layer.__module__.partition(".")[0]
    return importlib.import_module(root)


keras = _tf_keras_package()
KERAS3 = str(getattr(keras, "__version__", "3")).startswith("3.")
NAME = f"{keras.__name__} {getattr(keras, '__version__', '')}".strip()


def package_of(obj):
    """The top-level package of ``obj``'s class (``"keras"``, ``"tf_keras"``, ...)."""
    return type(obj).__module__.partition(".")[0]


def other_keras_hint(obj):
    """A sentence for a TypeError about ``obj`` when it comes from another Keras than
    ``tf.keras``'s (for example a Keras 3 object under ``TF_USE_LEGACY_KERAS=1``), else
    an empty string."""
    theirs = package_of(obj)
    if theirs in ("keras", "tf_keras") and theirs != keras.__name__:
        return (f" ({type(obj).__name__} comes from the {theirs} package, but tf.keras is "
                f"{NAME}: Perseus uses tf.keras's Keras (TF_USE_LEGACY_KERAS decides it); "
                f"make it with tf.keras)")
    return ""


def to_float(value):
    """A Keras variable, tensor or number (a learning rate, a loss scale) as a float."""
    if KERAS3:
        return float(keras.ops.convert_to_numpy(value))
    return float(keras.backend.get_value(value))


def is_variable(obj):
    """Whether ``obj`` is a variable: ``tf.Variable`` or (Keras 3) ``keras.Variable``."""
    if isinstance(obj, tf.Variable):
        return True
    return KERAS3 and isinstance(obj, keras.Variable)


def variable_name(var):
    """A variable's path (Keras 3) or name."""
    return getattr(var, "path", None) or var.name


def optimizer_variables(optimizer):
    """``optimizer``'s variables as a list (Keras 3: ``[]`` until it is built; Keras 2:
    ``variables`` is a method of the legacy optimizers)."""
    if optimizer is None:
        return []
    if KERAS3 and not getattr(optimizer, "built", False):
        return []
    found = optimizer.variables
    return list(found() if callable(found) else found)


def build_optimizer(optimizer, variables):
    """Create ``optimizer``'s variables (slots, iteration count) for ``variables`` if it
    has none yet, so that every rank holds the same list of them."""
    if KERAS3:
        if not getattr(optimizer, "built", True):
            optimizer.build(variables)
        return
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:  # a LossScaleOptimizer: its inner optimizer's variables
        build_optimizer(inner, variables)
        return
    legacy = getattr(keras.optimizers, "legacy", None)
    if legacy is not None and isinstance(optimizer, legacy.Optimizer):
        with tf.init_scope():
            optimizer._create_all_weights(list(variables))
        return
    build = getattr(optimizer, "build", None)
    if build is not None and not getattr(optimizer, "_built", False):
        build(list(variables))
