"""The package's version, in a module of its own: the launcher reads it without
importing the package's ``__init__`` (which installs the DDP hook)."""

__version__ = "0.1.0"
