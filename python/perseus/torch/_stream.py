"""Perseus's CUDA stream of a device as torch sees it, and the event ordering between
it and torch's current stream around work the core queues there."""

import contextlib

import torch

from perseus.common import gpu as _gpu

_external = {}


def perseus_stream(device):
    """Perseus's stream of ``device`` as a torch stream (made once per device)."""
    s = _external.get(device.index)
    if s is None:
        handle = _gpu.stream(device.index)
        s = _external[device.index] = torch.cuda.ExternalStream(handle, device=device)
    return s


@contextlib.contextmanager
def ordered(device):
    """Runs the body with ``device`` current, Perseus's stream of it waiting for torch's
    current stream first and torch's waiting for Perseus's after (events: neither the
    host nor the device waits), so the core's work sees what torch queued before and
    torch's later work sees the core's."""
    # The core makes the device current on this thread; the guard gives torch's current
    # device back afterwards.
    with torch.cuda.device(device):
        ours = perseus_stream(device)
        theirs = torch.cuda.current_stream(device)
        ours.wait_stream(theirs)
        try:
            yield
        finally:
            theirs.wait_stream(ours)
