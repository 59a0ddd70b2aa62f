"""PowerSGD compression of DDP's gradient buckets on Perseus: seed 001's
``AIAK_POWERSGD_COMPRESSION=1``, with ``AIAK_MATRIX_APPROXIMATION_RANK`` (r, default 1)
and ``AIAK_START_COMPRESS_ITER`` (default 1000: plain averaging before that step).

A gradient viewed as an n x m matrix M (first dimension by the rest) travels as two
thin matrices when r(n + m) < nm: P = M Q (n x r) is averaged over the ranks and
orthonormalized, then Q = M^T P (m x r) is averaged, and every rank writes the same
P Q^T in place of M. Each rank keeps what the approximation left out of its own M
and adds it to the next step's gradient (error feedback), and the averaged Q starts
the next step (a warm start), as Vogels, Karimireddy and Jaggi describe (NeurIPS
2019). The other gradients of the bucket (biases, small matrices) are averaged
exactly, in the same collective as the P's. docs/torch_distributed.md has the trade-offs.
"""

import torch

from perseus.common.knobs import get

__all__ = ["PowerSGD", "reduce", "settings"]


def settings():
    """``(on, rank, start)`` from seed 001's variables; ``ValueError`` names a bad one."""
    return (get("AIAK_POWERSGD_COMPRESSION"), get("AIAK_MATRIX_APPROXIMATION_RANK"),
            get("AIAK_START_COMPRESS_ITER"))


class PowerSGD:
    """One DDP model's compression state: per bucket, each rank's error feedback, and
    the Q matrices every rank shares."""

    def __init__(self, rank=1, start=1000):
        self.rank = rank
        self.start = start
        self.step = 0  # backward passes begun; the last bucket of each ends it
        self._errors = {}
        self._qs = {}

    def error(self, index, buf):
        """Bucket ``index``'s error feedback, zeros when new or reshaped."""
        e = self._errors.get(index)
        if e is None or e.shape != buf.shape or e.dtype != buf.dtype:
            e = self._errors[index] = torch.zeros_like(buf)
        return e

    def q(self, index, position, cols, rank, like):
        """The Q of gradient ``position`` of bucket ``index``: the last step's, or one
        drawn from a seed every rank shares."""
        key = (index, position)
        q = self._qs.get(key)
        if q is None or q.shape != (cols, rank):
            seed = 1_000_003 * index + position
            q = torch.randn(cols, rank, generator=torch.Generator().manual_seed(seed))
            q = self._qs[key] = q.to(dtype=like.dtype, device=like.device)
        return q


def _split(bucket, rank):
    """The bucket's gradients as ``(matrix view, r, offset)`` to compress and the rest."""
    buf = bucket.buffer()
    matrices, rest = [], []
    for position, g in enumerate(bucket.gradients()):
        rows = g.shape[0] if g.dim() > 1 else 0
        cols = g.numel() // rows if rows else 0
        r = min(rank, rows, cols)
        if rows and r * (rows + cols) < rows * cols:
            matrices.append((position, g.view(rows, cols), r,
                             g.storage_offset() - buf.storage_offset()))
        else:
            rest.append(g)
    return matrices, rest


def _unpack(flat, tensors):
    """Copy consecutive slices of ``flat`` into ``tensors``."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def reduce(ps, bucket, prefix, process_set):
    """PowerSGD (``ps``, a :class:`PowerSGD`) of one DDP gradient bucket, the reductions
    named after ``prefix`` over ``process_set``: ``(bucket's buffer, finish)``, where
    ``finish()`` waits for them and returns the buffer reduced; None before
    ``AIAK_START_COMPRESS_ITER``, when the bucket is to be averaged exactly.
    perseus.torch.ddp's communication hook calls it."""
    from perseus.torch.horovod import mpi_ops

    compress = ps.step >= ps.start
    if bucket.is_last():
        ps.step += 1
    if not compress:
        return None
    buf, index = bucket.buffer(), bucket.index()
    error = ps.error(index, buf)
    buf.add_(error)
    matrices, rest = _split(bucket, ps.rank)
    qs = [ps.q(index, position, m.shape[1], r, buf) for position, m, r, _ in matrices]
    pmats = [m @ q for (_, m, _, _), q in zip(matrices, qs)]
    first = torch.cat([p.flatten() for p in pmats] + [g.flatten() for g in rest])

    def average(flat, part):
        return mpi_ops.allreduce_async_(flat, name=f"{prefix}.bucket{index}.{part}",
                                        op=mpi_ops.Average, process_set=process_set)

    handle = average(first, "p")

    def finish():
        handle.wait()
        _unpack(first, pmats + rest)
        for p in pmats:
            p.copy_(torch.linalg.qr(p.float()).Q)
        new_qs = [m.t() @ p for (_, m, _, _), p in zip(matrices, pmats)]
        if new_qs:
            second = torch.cat([q.flatten() for q in new_qs])
            average(second, "q").wait()
            _unpack(second, qs)  # the shared Q: this step's approximation, the next's start
        error.zero_()
        for (_, m, _, offset), p, q in zip(matrices, pmats, qs):
            approx = p @ q.t()
            error[offset:offset + m.numel()].view_as(m).copy_(m - approx)
            m.copy_(approx)
        return buf

    return buf, finish
