"""The Python side's reader of settings, and the one reader of the process environment on
the Python side.

Every setting is declared once, in the core's table (``src/params``, docs/environment.md):
its kind, range, default, the other names it is read under, who acts on it and the
allowed values in words. :data:`KNOBS` is that table as the core gives it
(``_core.params()``); :func:`get` reads one setting and checks it: a value outside its
range, of another kind, not finite, or too large is a ``ValueError`` that names the
variable, what it must be and what it got. The Python side acts on its own settings
(deep gradient compression and the overlapped step of seed 000, PowerSGD of seed 001,
the DDP switches, the elastic worker's timeout) and reads some of the core's too.

The variables launchers hand their ranks (where they are, how to reach the rendezvous,
which elastic round) are no settings: each is declared by the module whose protocol it
belongs to, and read through :func:`text` and :func:`given`. Writing the environment
(a launcher's, or a rank's for the processes it starts) needs no reader.
"""

import math
import os
import re
from dataclasses import dataclass

from perseus import _core

__all__ = ["KNOBS", "Knob", "environment", "get", "given", "knob", "rendezvous", "text"]

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")
# A number as the core reads one: ASCII only, no digit separators.
_INTEGER = re.compile(r"\+?[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)",
                     re.IGNORECASE)


@dataclass(frozen=True)
class Knob:
    """One setting: ``kind`` is ``bool``, ``int``, ``float`` (finite), ``ratios`` (a list
    of floats, separated by spaces or commas, each within the range), ``str`` (one of
    ``choices``) or ``text``; numbers lie within ``low``..``high`` (``low`` itself
    excluded when ``low_open``). ``allowed`` says what values are allowed, in the core's
    words."""

    name: str
    kind: str
    default: object
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    choices: tuple = ()
    aliases: tuple = ()
    scope: str = "python"
    allowed: str = ""
    doc: str = ""

    def must(self):
        """What a value must be, in words."""
        return self.allowed

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
            # The core's flags are 0 or 1; the Python side's also true/false, yes/no.
            true, false = (_TRUE, _FALSE) if self.scope != "core" else (("1",), ("0",))
            return True if low in true else False if low in false else None
        if self.kind == "str":
            return next((c for c in self.choices if c.lower() == text.lower()), None)
        if self.kind == "text":
            return text
        if self.kind == "ratios":
            values = [self._number(part, float) for part in text.replace(",", " ").split()]
            return values if values and None not in values else None
        return self._number(text, int if self.kind == "int" else float)

    def _number(self, text, kind):
        if len(text) > 64 or not (_INTEGER if kind is int else _NUMBER).fullmatch(text):
            return None
        value = kind(text)
        if kind is float and not math.isfinite(value):
            return None
        above = value > self.low if self.low_open else value >= self.low
        return value if above and value <= self.high else None


_KINDS = {"flag": "bool", "int": "int", "float": "float", "ratios": "ratios", "choice": "str",
          "text": "text"}


def _knob(param):
    """A setting of the core's table (one dict of ``_core.params()``) as a :class:`Knob`."""
    low, high = param["low"], param["high"]
    return Knob(param["name"], _KINDS[param["kind"]], param["default"],
                -math.inf if low is None else low, math.inf if high is None else high,
                param["low_open"], tuple(param["choices"]), tuple(param["aliases"]),
                param["scope"], param["allowed"], param["doc"])


#: The settings, as the core's table declares them.
KNOBS = tuple(_knob(p) for p in _core.params())

_TABLE = {k.name: k for k in KNOBS}


def knob(name):
    """The setting ``name`` (``KeyError`` for a name no table row or alias has)."""
    return _TABLE[name]


def get(name, environ=None):
    """The value of setting ``name`` in ``environ`` (default: this process's
    environment), else under its first alias set, else its default."""
    knob = _TABLE[name]
    env = environment(environ)
    for var in (knob.name, *knob.aliases):
        text = env.get(var, "").strip()
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
