"""Assertions shared by the TensorFlow worker scripts (a failure exits non-zero): the torch
workers' helpers, which import no framework until asked."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.append(str(Path(__file__).parents[2] / "python" / "workers"))
from _helpers import close_array as close  # noqa: F401 - re-exported
from _helpers import done, raises, regression_batch  # noqa: F401 - re-exported
