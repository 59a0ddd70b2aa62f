"""What ``import perseus`` sets up: once torch is imported, its DistributedDataParallel
reduces gradients through Perseus (:mod:`perseus.torch.ddp`, docs/torch_distributed.md),
torch.distributed has a ``perseus`` backend (:mod:`perseus.torch.backend`), and seed
001's names are in torch's namespaces (:mod:`perseus.torch.aiak`).

Nothing here imports torch. When torch is already imported the patch applies at
once; otherwise a finder on ``sys.meta_path`` waits for torch's own import to
finish and applies it then. A failure never breaks torch's import: it becomes a
warning, and DDP keeps torch's communication.
"""

import importlib.abc
import sys
import warnings

_TARGET = "torch"


def _after_torch():
    try:
        from perseus import support

        # An unsupported torch leaves DDP to torch, saying why (before ddp reaches torch).
        support.check("torch", sys.modules[_TARGET].__version__)
        from perseus.torch import ddp

        ddp.patch()
    except Exception as e:  # noqa: BLE001 - reported, never raised into torch's import
        warnings.warn(f"perseus: DistributedDataParallel keeps torch's communication: {e}",
                      RuntimeWarning, stacklevel=2)
    else:
        try:
            from perseus.torch import backend

            backend.register()
        except Exception as e:  # noqa: BLE001 - as above
            warnings.warn(f"perseus: torch.distributed has no perseus backend: {e}",
                          RuntimeWarning, stacklevel=2)
    try:
        from perseus.torch import aiak

        aiak.install()
    except Exception as e:  # noqa: BLE001 - as above
        warnings.warn(f"perseus: seed 001's names are not in torch's namespaces: {e}",
                      RuntimeWarning, stacklevel=2)


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Finds torch with the other finders and runs ``_after_torch`` after its import."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _uninstall()
            _after_torch()

        loader.exec_module = exec_then_patch
        return spec


_finder = None


def _uninstall():
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None


def install():
    """Patch DDP now if torch is imported, else as soon as it is (idempotent)."""
    global _finder
    if _TARGET in sys.modules:
        _after_torch()
    elif _finder is None:
        _finder = _TorchFinder()
        sys.meta_path.insert(0, _finder)
