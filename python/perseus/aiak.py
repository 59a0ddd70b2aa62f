"""``perseus.aiak`` is :mod:`perseus.torch.aiak` (torch-only modules live under perseus.torch);
the old name stays for scripts that import it, as the same module."""

import sys

from perseus.torch import aiak as _module

sys.modules[__name__] = _module
