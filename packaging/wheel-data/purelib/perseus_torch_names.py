"""AIAK-Training's names in torch's own namespaces whenever torch is imported, in
processes that never import perseus: ``torch.optim.LAMB``,
``torch.cuda.amp.aiak_amp_decorate`` and ``torch.cuda.amp.aiak_amp_parameters``.
AIAK-Training shipped them in its own torch build; scripts written for it call them
without importing anything else.

The wheel's ``perseus_aiak_activation.pth`` calls :func:`watch` at start-up. This module
imports nothing: a finder waits for torch's own import, then gives ``torch.optim`` and
``torch.cuda.amp`` a module ``__getattr__`` that loads Perseus's object the first time a
script reads one of those names. A process that never imports torch, or never reads
them, loads nothing of Perseus. Reading one loads the ``perseus`` package, with what
``import perseus`` does (DistributedDataParallel then reduces through Perseus).
"""

import sys

# module -> name -> (Perseus's module, its attribute)
NAMES = {
    "torch.optim": {"LAMB": ("perseus.torch.optim", "LAMB")},
    "torch.cuda.amp": {
        "aiak_amp_decorate": ("perseus.torch.amp", "amp_decorate"),
        "aiak_amp_parameters": ("perseus.torch.amp", "amp_parameters"),
    },
}


def _serve(module, names):
    """Give ``module`` the attributes ``names`` lists, loaded when first read."""
    before = vars(module).get("__getattr__")

    def __getattr__(name):
        if name not in names:
            if before is not None:
                return before(name)
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        import importlib

        owner, attr = names[name]
        value = getattr(importlib.import_module(owner), attr)
        setattr(module, name, value)
        return value

    module.__getattr__ = __getattr__


def give_names():
    """Put the names where torch has none of its own (torch is imported)."""
    import importlib

    for where, names in NAMES.items():
        try:
            module = importlib.import_module(where)
        except Exception:  # noqa: BLE001, S112 - a torch without the module has no names
            continue
        missing = {n: v for n, v in names.items() if n not in vars(module)}
        if missing:
            _serve(module, missing)


class _TorchWatch:
    """A finder that lets the path finder find torch, then gives the names once torch's
    own import has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None  # another finder finds it: the names wait for import perseus
        run = loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                give_names()
            except Exception as e:  # noqa: BLE001 - said, never raised into torch's import
                import warnings

                warnings.warn(f"perseus: AIAK-Training's names are not in torch: {e}",
                              RuntimeWarning, stacklevel=2)

        loader.exec_module = exec_module
        return spec


def watch():
    """Give the names once torch is imported (now, if it is)."""
    if "torch" in sys.modules:
        give_names()
    elif not any(isinstance(f, _TorchWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWatch())
