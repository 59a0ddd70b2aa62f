"""perseus.common.ops.copy_into, the out-of-place broadcast root's copy: every byte at
sizes on both sides of STREAM_FROM and at a misaligned start, and its refusals."""

import pytest
import torch
from perseus.common import ops
from torch.utils.dlpack import to_dlpack


@pytest.mark.parametrize("count", [0, 3, ops.STREAM_FROM - 1, ops.STREAM_FROM + 77])
def test_every_byte_lands(count):
    src = torch.randint(0, 256, (count + 1,), dtype=torch.uint8)[1:]  # odd address
    dst = torch.full((count + 2,), 7, dtype=torch.uint8)
    ops.copy_into(to_dlpack(dst[1:-1]), to_dlpack(src))
    assert torch.equal(dst[1:-1], src)
    assert dst[0] == 7 and dst[-1] == 7, "bytes outside the output were written"


def test_mismatched_and_overlapping_tensors_are_refused():
    a = torch.zeros(8)
    with pytest.raises(ValueError, match="copy_into: 16 bytes into 32 bytes"):
        ops.copy_into(to_dlpack(a), to_dlpack(torch.ones(4)))
    with pytest.raises(ValueError, match="copy_into: the tensors overlap"):
        ops.copy_into(to_dlpack(a[:4]), to_dlpack(a[2:6]))
    assert torch.equal(a, torch.zeros(8))
