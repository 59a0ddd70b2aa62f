"""Perseus: Horovod-compatible data-parallel distributed training with a Rust core.

Import a front-end to train: ``import perseus.torch.horovod as hvd`` (PyTorch).
``import perseus`` alone makes torch's DistributedDataParallel reduce its gradients
through Perseus once torch is imported (perseus.torch.ddp, docs/torch_distributed.md; ``PERSEUS_DDP=0``
turns that off). ``perseus.run(func, np=...)`` runs a function as a job (Horovod's
``horovod.run``, docs/launching.md). This package itself imports nothing heavy: no
framework and not the native core.
"""

from perseus import _autopatch
from perseus._version import __version__  # noqa: F401 - perseus.__version__

_autopatch.install()


def __getattr__(name):
    # perseus.run (Horovod's horovod.run) loads the launcher only when asked for.
    if name == "run":
        from perseus.runner.run_function import run

        return run
    # The torch-only modules' old names: perseus.ddp is perseus.torch.ddp, and so on.
    if name in ("ddp", "powersgd", "aiak"):
        import importlib

        return importlib.import_module(f"perseus.torch.{name}")
    raise AttributeError(f"module 'perseus' has no attribute {name!r}")
