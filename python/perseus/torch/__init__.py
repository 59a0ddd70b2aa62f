"""PyTorch front-end. ``import perseus.torch as hvd`` is the same as
``import perseus.torch.horovod as hvd``: the Horovod 0.28 ``horovod.torch`` API.
"""

import torch as _torch

from perseus import support as _support

# Before anything of Perseus's reaches torch: an unsupported torch is named here.
_support.check("torch", _torch.__version__)

from perseus.torch.horovod import *
from perseus.torch.horovod import __all__  # noqa: F401
