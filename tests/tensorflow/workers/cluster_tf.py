"""The function the Ray and Spark tests of tests/tensorflow run on their workers (imported
there by name)."""


def allreduce_and_step():
    """Sum and average allreduces of a tensor scaled by the rank, and the gradient of one
    step through DistributedGradientTape of a loss scaled by the rank."""
    import numpy as np
    import perseus.tensorflow.horovod as hvd
    import tensorflow as tf

    hvd.init()
    scale = float(hvd.rank() + 1)
    x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) * scale)
    summed = hvd.allreduce(x, op=hvd.Sum, name="cluster.sum")
    averaged = hvd.allreduce(x, name="cluster.average")
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w) * scale
    (grad,) = hvd.DistributedGradientTape(tape).gradient(loss, [w])
    return {"rank": hvd.rank(), "size": hvd.size(), "sum": summed.numpy().tolist(),
            "average": averaged.numpy().tolist(), "grad": grad.numpy().tolist()}
