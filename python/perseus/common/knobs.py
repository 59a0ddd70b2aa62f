"""Every setting the Python side reads from the environment, declared once; and the one
reader of the process environment on the Python side.

The core reads and checks its own (``src/config``, docs/environment.md); these are the
ones only Python acts on: deep gradient compression and the overlapped step (seed
000), PowerSGD (seed 001), the DDP switches and the elastic worker's timeout. Each
:class:`Knob` has its type, default, range and, where a seed gave the variable another
name, that alias. :func:`get` reads one and checks it: a value outside its range, of
another type, not finite, or too large is a ``ValueError`` that names the variable,
what it must be and what it got.

The variables launchers hand their ranks (where they are, how to reach the rendezvous,
which elastic round) are no settings: each is declared by the module whose protocol it
belongs to, and read through :func:`text` and :func:`given`. Writing the environment
(a launcher's, or a rank's for the processes it starts) needs no reader.
"""

import math
import os
from dataclasses import dataclass

__all__ = ["KNOBS", "Knob", "environment", "get", "given", "rendezvous", "text"]

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


@dataclass(frozen=True)
class Knob:
    """One variable: ``kind`` is ``bool``, ``int``, ``float`` (finite) or ``ratios`` (a
    list of floats, separated by spaces or commas, each within the range); numbers lie
    within ``low``..``high`` (``low`` itself excluded when ``low_open``); ``choices``
    limits a ``str``."""

    name: str
    kind: str
    default: object
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    choices: tuple = ()
    alias: str = ""
    doc: str = ""

    def must(self):
        """What a value must be, in words."""
        if self.kind == "bool":
            return "0 or 1 (or true/false)"
        if self.kind == "str":
            return " or ".join(self.choices)
        what = {"int": "an integer", "float": "a number",
                "ratios": "numbers separated by spaces, each"}[self.kind]
        low, high = f"{self.low:g}", f"{self.high:g}"
        if self.high == math.inf:
            return f"{what} {'greater than' if self.low_open else '>='} {low}"
        if self.low_open:
            return f"{what} greater than {low} and at most {high}"
        return f"{what} from {low} to {high}"

    def parse(self, text, name=None):
        """The value of ``text`` (stripped, not empty); ``ValueError`` naming the variable
        (``name``: the alias it was read under) when it is not one."""
        value = self._value(text)
        if value is None:
            raise ValueError(f"{name or self.name} must be {self.must()}, got {text!r}")
        return value

    def _value(self, text):
        if self.kind == "bool":
            low = text.lower()
            return True if low in _TRUE else False if low in _FALSE else None
        if self.kind == "str":
            low = text.lower()
            return low if low in self.choices else None
        if self.kind == "ratios":
            values = [self._number(part, float) for part in text.replace(",", " ").split()]
            return values if values and None not in values else None
        return self._number(text, int if self.kind == "int" else float)

    def _number(self, text, kind):
        if len(text) > 64:  # no number of ours is that long; int() of it would be slow
            return None
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            return None
        if kind is float and not math.isfinite(value):
            return None
        above = value > self.low if self.low_open else value >= self.low
        return value if above and value <= self.high else None


#: The settings, each declared here only.
KNOBS = (
    # Deep gradient compression (docs/dgc.md) and the overlapped step (docs/optimizers.md).
    Knob("PERSEUS_DGC", "bool", False, doc="deep gradient compression (--dgc)"),
    Knob("PERSEUS_DGC_COMPRESS_RATIO", "float", 0.001, 0, 1, low_open=True,
         doc="share of a gradient's elements sent"),
    Knob("PERSEUS_DGC_SAMPLE_RATIO", "float", 0.01, 0, 1, low_open=True,
         doc="share of a gradient's elements sampled to find the threshold"),
    Knob("PERSEUS_DGC_STRIDED_SAMPLE", "bool", True, doc="sample at a stride, not at random"),
    Knob("PERSEUS_DGC_COMPRESS_UPPER_BOUND", "float", 1.3, 1, 100,
         doc="most elements selected, as a multiple of the ratio's count"),
    Knob("PERSEUS_DGC_COMPRESS_LOWER_BOUND", "float", 0.8, 0, 1, low_open=True,
         doc="fewest elements selected, as a multiple of the ratio's count"),
    Knob("PERSEUS_DGC_MAX_ADAPTATION_ITERS", "int", 10, 0, 1000,
         doc="threshold adjustments per step"),
    Knob("PERSEUS_DGC_RESAMPLE", "bool", True, doc="resample when too few are selected"),
    Knob("PERSEUS_DGC_FP16_VALUES", "bool", False, doc="send the values as float16"),
    Knob("PERSEUS_DGC_INT32_INDICES", "bool", False, doc="send the indices as int32"),
    Knob("PERSEUS_DGC_WARMUP_EPOCHS", "int", 0, 0, 10000, doc="epochs of warm-up"),
    Knob("PERSEUS_DGC_WARMUP_COEFF", "ratios", None, 0, 1, low_open=True,
         doc="the compress ratio of each warm-up epoch"),
    Knob("PERSEUS_DGC_MOMENTUM_MASKING", "bool", True,
         doc="clear the momentum of the elements sent"),
    Knob("PERSEUS_OVERLAP_BACKWARD_AND_STEP", "bool", False,
         doc="step each parameter as soon as its gradient is reduced"),
    Knob("PERSEUS_CLIP_GRAD_FUNC", "str", None, choices=("norm", "value"),
         doc="gradient clipping of DGC and the overlapped step"),
    Knob("PERSEUS_CLIP_GRAD_FUNC_PARAMS", "float", None, 0, low_open=True,
         doc="the norm or value to clip at"),
    # PowerSGD on DDP's buckets (seed 001, docs/ddp.md).
    Knob("AIAK_POWERSGD_COMPRESSION", "bool", False, doc="PowerSGD on DDP's buckets"),
    Knob("AIAK_MATRIX_APPROXIMATION_RANK", "int", 1, 1, 1024, doc="PowerSGD's rank"),
    Knob("AIAK_START_COMPRESS_ITER", "int", 1000, 0,
         doc="steps reduced exactly before PowerSGD starts"),
    # DDP (docs/ddp.md).
    Knob("PERSEUS_DDP", "bool", True, doc="DDP models reduce through Perseus"),
    Knob("PERSEUS_USE_DDP_LAUNCHER", "bool", True,
         doc="take the ranks from torchrun's RANK and WORLD_SIZE"),
    # Elastic workers (docs/elastic.md); perseusrun sets it from --elastic-timeout.
    Knob("PERSEUS_ELASTIC_TIMEOUT", "float", 600.0, 0, 1e9, low_open=True,
         doc="seconds a worker waits for a round to take it"),
)

_TABLE = {k.name: k for k in KNOBS}


def get(name, environ=None):
    """The value of setting ``name`` in ``environ`` (default: this process's
    environment), else under its alias, else its default."""
    knob = _TABLE[name]
    env = environment(environ)
    for var in (knob.name, knob.alias):
        text = env.get(var, "").strip() if var else ""
        if text:
            return knob.parse(text, var)
    return knob.default


def environment(environ=None):
    """``environ``, or the process environment (a mapping to read and to write)."""
    return os.environ if environ is None else environ


def text(name, environ=None):
    """The value of variable ``name``, stripped; None when it is unset or blank."""
    return environment(environ).get(name, "").strip() or None


def given(name, environ=None):
    """Whether variable ``name`` is set at all (blank counts: launchers set some so)."""
    return name in environment(environ)


def rendezvous(environ=None):
    """``(address, port, secret)`` of the rendezvous the launcher runs for its ranks, or
    None where it runs none; ``ValueError`` names a port that is no port."""
    addr, port = text("PERSEUS_RENDEZVOUS_ADDR", environ), text("PERSEUS_RENDEZVOUS_PORT",
                                                                  environ)
    if not (addr and port):
        return None
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise ValueError(f"PERSEUS_RENDEZVOUS_PORT must be a TCP port from 1 to 65535, got "
                         f"{port!r}")
    return addr, int(port), text("PERSEUS_SECRET", environ) or ""
