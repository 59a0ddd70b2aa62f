"""Perseus: Horovod-compatible data-parallel distributed training with a Rust core.

Import a front-end to train: ``import perseus.torch.horovod as hvd`` (PyTorch).
``import perseus`` alone makes torch's DistributedDataParallel reduce its gradients
through Perseus once torch is imported (perseus.ddp, docs/ddp.md; ``PERSEUS_DDP=0``
turns that off). This package itself imports nothing heavy: no framework and not
the native core.
"""

from perseus import _autopatch

__version__ = "0.1.0"

_autopatch.install()
