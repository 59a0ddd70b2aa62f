"""The variables that tell a rank where it stands in the job: its ranks and sizes
under both PERSEUS_* and HOROVOD_* names (perseusrun sets them at start; an elastic
worker sets them again at each round). It imports nothing, so that the launcher
can use it without the native core."""

#: The topology in the order of a rank's numbers: rank, size, local rank and size,
#: cross rank and size.
NAMES = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")


def variables(**values):
    """``variables(RANK=1, ...)`` -> ``{"PERSEUS_RANK": "1", "HOROVOD_RANK": "1", ...}``."""
    env = {}
    for key, value in values.items():
        env["PERSEUS_" + key] = env["HOROVOD_" + key] = str(value)
    return env
