"""Perseus: Horovod-compatible data-parallel distributed training with a Rust core.

Import a front-end to train: ``import perseus.torch.horovod as hvd`` (PyTorch).
This package itself imports nothing heavy: no framework and not the native core.
"""

__version__ = "0.1.0"
