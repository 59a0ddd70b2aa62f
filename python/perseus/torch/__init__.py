"""PyTorch front-end. ``import perseus.torch as hvd`` is the same as
``import perseus.torch.horovod as hvd``: the Horovod 0.28 ``horovod.torch`` API (loaded
at the first attribute asked for). Beside it: torch's DDP through Perseus (:mod:`ddp`,
:mod:`powersgd`), seed 001's names (:mod:`aiak`), AMP O2 (:mod:`amp`), DGC (:mod:`dgc`),
the fused optimizers (:mod:`optim`) and the device kernels (:mod:`kernels`).
"""

import importlib

import torch as _torch

from perseus import support as _support

# Before anything of Perseus's reaches torch: an unsupported torch is named here.
_support.check("torch", _torch.__version__)


def __getattr__(name):
    # The Horovod API loads at its first use, so that the torch-only modules beside it
    # (perseus.torch.ddp, which ``import perseus`` loads once torch is imported) do not
    # load it with them.
    horovod = importlib.import_module("perseus.torch.horovod")
    if name in globals():  # a submodule of this package that the API loaded
        return globals()[name]
    return getattr(horovod, name)


def __dir__():
    horovod = importlib.import_module("perseus.torch.horovod")
    return sorted(set(globals()) | set(horovod.__all__))
