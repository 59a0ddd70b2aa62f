"""A NumPy reference of Horovod's Adasum rule, for the workers that check it."""

import numpy as np


def pair(a, b):
    """Two vectors combined: (1 - a·b / 2|a|²) a + (1 - a·b / 2|b|²) b."""
    dot = float(a @ b)
    aa, bb = float(a @ a), float(b @ b)
    return (1 - dot / (2 * aa) if aa else 1) * a + (1 - dot / (2 * bb) if bb else 1) * b


def reference(parts):
    """The ranks' arrays (in rank order) combined pairwise, level by level, in float64;
    flat."""
    level = [np.asarray(p).astype(np.float64).ravel() for p in parts]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return level[0]
