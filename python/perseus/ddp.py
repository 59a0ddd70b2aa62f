"""``perseus.ddp`` is :mod:`perseus.torch.ddp` (torch-only modules live under perseus.torch);
the old name stays for scripts that import it, as the same module."""

import sys

from perseus.torch import ddp as _module

sys.modules[__name__] = _module
