"""Perseus for TensorFlow: ``perseus.tensorflow.horovod`` (Horovod's ``horovod.tensorflow``)
and ``perseus.tensorflow.keras`` (Horovod's ``horovod.tensorflow.keras``)."""
