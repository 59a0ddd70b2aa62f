"""A synthetic MNIST-like data set for the TensorFlow and MXNet examples, made with numpy from a seed
(nothing is downloaded): 28x28 images drawn from ten fixed class patterns (random
strokes), shifted by a few pixels and covered in noise."""

import numpy as np


def class_patterns(seed=42):
    """Ten 28x28 prototypes, each a few thick random strokes."""
    rng = np.random.RandomState(seed)
    ys, xs = np.meshgrid(np.arange(28.0), np.arange(28.0), indexing="ij")
    patterns = np.zeros((10, 28, 28), np.float32)
    for c in range(10):
        for _ in range(3):
            x0, y0, x1, y1 = rng.rand(4) * 16 + 6
            for t in np.linspace(0, 1, 12):
                cx, cy = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
                patterns[c] = np.maximum(patterns[c], np.exp(-((xs - cx) ** 2 +
                                                               (ys - cy) ** 2) / 3.0))
    return patterns


def load(n, seed, patterns=None):
    """``n`` images (N, 28, 28, 1), normalized like MNIST, and their int64 labels."""
    patterns = class_patterns() if patterns is None else patterns
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, n)
    shifts = rng.randint(-3, 4, (n, 2))
    images = np.stack([np.roll(patterns[y], tuple(s), axis=(0, 1))
                       for y, s in zip(labels, shifts)])
    images += 0.35 * rng.randn(*images.shape).astype(np.float32)
    return ((images - 0.13) / 0.31)[..., None].astype(np.float32), labels.astype(np.int64)


def dense_v1(inputs, units, name, activation=None):
    """A dense layer for the tf.compat.v1 graph examples (Keras 3 removed
    ``tf.compat.v1.layers``): Glorot-initialized kernel and zero bias variables."""
    import tensorflow as tf

    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [inputs.shape[-1], units],
            initializer=tf.compat.v1.glorot_uniform_initializer())
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
    out = tf.matmul(inputs, kernel) + bias
    return activation(out) if activation is not None else out
