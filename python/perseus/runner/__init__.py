"""``perseusrun``: start a Perseus job on one or more hosts.

``hosts`` parses host lists and places ranks, ``job`` spawns ranks, relays their
output and tears the job down, ``launch`` is the command line; ``run`` (also
``perseus.run``, Horovod's ``horovod.runner.run``) runs a Python function as a job
(``run_function``).
"""


def __getattr__(name):
    # perseus.runner.run: loaded when asked for, so that importing a submodule stays light.
    if name == "run":
        from perseus.runner.run_function import run

        return run
    raise AttributeError(f"module 'perseus.runner' has no attribute {name!r}")
