"""Perseus for TensorFlow: ``perseus.tensorflow.horovod`` (Horovod's ``horovod.tensorflow``)
and ``perseus.tensorflow.keras`` (Horovod's ``horovod.tensorflow.keras``)."""

import tensorflow as _tf

from perseus import support as _support

# Before anything of Perseus's reaches TensorFlow: an unsupported one is named here.
_support.check("tensorflow", _tf.__version__)
