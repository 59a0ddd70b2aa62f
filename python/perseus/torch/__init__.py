"""PyTorch front-end. ``import perseus.torch as hvd`` is the same as
``import perseus.torch.horovod as hvd``: the Horovod 0.28 ``horovod.torch`` API.
"""

from perseus.torch.horovod import *
from perseus.torch.horovod import __all__  # noqa: F401
