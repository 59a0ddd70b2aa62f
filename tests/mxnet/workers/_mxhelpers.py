"""Assertions shared by the MXNet worker scripts (a failure exits non-zero): the torch
workers' helpers, which import no framework until asked."""

import os
import sys
from pathlib import Path

os.environ.setdefault("MXNET_USE_OPERATOR_TUNING", "0")  # fast start (seed 003 §4.6.1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.append(str(Path(__file__).parents[2] / "python" / "workers"))
from _helpers import close_array as close  # noqa: F401 - re-exported
from _helpers import done, raises, regression_batch  # noqa: F401 - re-exported
