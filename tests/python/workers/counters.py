"""hvd.counters(): operations, tensors, bytes by host, negotiation and cache hits."""

import perseus.torch.horovod as hvd
import torch
from _helpers import direct_reads, done


def delta(before, after):
    return {k: after[k] - before[k] for k in after}


def total(value):
    """Sum of one integer over all ranks."""
    return int(hvd.allreduce(torch.tensor([value], dtype=torch.int64), op=hvd.Sum,
                             name="counters.total")[0])


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    c0 = hvd.counters()
    assert set(c0) == {"operations", "tensors", "fused_buffers", "fused_bytes_max",
                       "negotiation_messages",
                       "cache_hits", "bytes_intra_host", "bytes_inter_host",
                       "compression_resends", "negotiations_skipped",
                       "bytes_extra_streams", "nccl_operations", "autotune_changes",
                       "stall_warnings", "control_frames_sent", "control_bytes_sent",
                       "control_frames_received", "control_bytes_received",
                       "vote_messages", "vote_bytes", "lane_operations",
                       "transfer_rounds", "linked_peers"}, c0

    # One 1 MiB allreduce: a ring moves (n-1)/n of the buffer in each of its two
    # phases from every rank, 2(n-1) MiB over the whole job; no byte leaves the host.
    nbytes = 1 << 20
    before = hvd.counters()
    hvd.allreduce_(torch.ones(nbytes // 4), op=hvd.Sum, name="big")
    d = delta(before, hvd.counters())
    assert d["operations"] == 1 and d["tensors"] == 1, d
    assert d["bytes_inter_host"] == 0, d
    if n == 2:
        assert d["bytes_intra_host"] == nbytes, d
    assert total(d["bytes_intra_host"]) == 2 * (n - 1) * nbytes
    # The ring's rounds: n - 1 to reduce, n - 1 to gather.
    assert d["transfer_rounds"] == 2 * (n - 1), (r, d)
    assert 1 <= hvd.counters()["linked_peers"] <= n - 1, r

    # From 2 MiB (collective/reading.rs), each rank reads its chunk of the others'
    # buffers, then their reduced chunks, out of their memory (PERSEUS_SHM_DIRECT, where
    # the kernel allows it): it sends each other rank a 17-byte offer for the first, a
    # 16-byte one for the second and a 1-byte answer. Otherwise the ring, as above.
    direct = direct_reads()
    abytes = 4 << 20
    t = torch.arange(abytes // 4, dtype=torch.float32) * (r + 1)
    before = hvd.counters()
    hvd.allreduce_(t, op=hvd.Sum, name="bigger")
    d = delta(before, hvd.counters())
    assert torch.equal(t, torch.arange(abytes // 4, dtype=torch.float32) * (n * (n + 1) // 2))
    if direct:
        assert d["bytes_intra_host"] == 34 * (n - 1), (r, d)
    else:
        assert total(d["bytes_intra_host"]) == 2 * (n - 1) * abytes, (r, d)

    # A 4 MiB broadcast from rank 1. Among three ranks or more, read straight from the
    # root's memory: the root sends each rank a 16-byte offer and each answers with one
    # byte. Otherwise (and between two ranks: collective/broadcast.rs) a chain: n-1
    # copies of the buffer.
    bbytes = 4 << 20
    for out_of_place in (False, True):
        src = torch.arange(bbytes // 4, dtype=torch.float32) * (3 if r == 1 else 0)
        before = hvd.counters()
        if out_of_place:
            got = hvd.broadcast(src, root_rank=1, name="bcast.new")
            assert torch.equal(src, torch.arange(bbytes // 4, dtype=torch.float32)
                               * (3 if r == 1 else 0)), "the input is left alone"
        else:
            got = src
            hvd.broadcast_(got, root_rank=1, name="bcast.in_place")
        d = delta(before, hvd.counters())
        assert torch.equal(got, torch.arange(bbytes // 4, dtype=torch.float32) * 3), (r, got)
        if direct and n >= 3:
            assert d["bytes_intra_host"] == (16 * (n - 1) if r == 1 else 1), (r, d)
        else:
            assert total(d["bytes_intra_host"]) == (n - 1) * bbytes, (r, d)

    # An allgather and an alltoall of 1 MiB blocks: read from each owner's memory where
    # the broadcast was (a 16-byte offer to each rank and a 1-byte answer from each),
    # else sent: by the ring, n-1 blocks from each rank; by the alltoall, one to each.
    # Between two ranks the allgather takes the ring (collective/ring.rs).
    block = nbytes // 4
    before = hvd.counters()
    got = hvd.allgather(torch.full((block,), float(r)), name="gather.big")
    want = torch.cat([torch.full((block,), float(p)) for p in range(n)])
    assert torch.equal(got.reshape(-1), want), r
    d = delta(before, hvd.counters())
    reads = direct and n >= 3
    assert d["bytes_intra_host"] == (17 * (n - 1) if reads else (n - 1) * nbytes), (r, d)
    before = hvd.counters()
    src = torch.cat([torch.full((block,), float(r * 10 + p)) for p in range(n)])
    got = hvd.alltoall(src, name="alltoall.big")
    want = torch.cat([torch.full((block,), float(p * 10 + r)) for p in range(n)])
    assert torch.equal(got, want), r
    d = delta(before, hvd.counters())
    assert d["bytes_intra_host"] == (17 * (n - 1) if direct else (n - 1) * nbytes), (r, d)

    # Ten tensors in flight together: each is counted once, fused or not.
    before = hvd.counters()
    ts = [torch.full((16,), float(r)) for _ in range(10)]
    for h in [hvd.allreduce_async_(t, op=hvd.Sum, name=f"small.{i}") for i, t in enumerate(ts)]:
        hvd.synchronize(h)
    d = delta(before, hvd.counters())
    assert d["tensors"] == 10 and 1 <= d["operations"] <= 10, d
    assert d["fused_buffers"] <= d["operations"], d
    assert d["negotiation_messages"] >= 1, d

    # The same name every step: after the first, ranks other than the coordinator
    # send a cache id instead of the request. (Asynchronous, so through the engine: a
    # blocking one this small may run among the callers, PERSEUS_LANE_BYTES.)
    def steady():
        hvd.synchronize(hvd.allreduce_async(torch.ones(4), name="steady"))

    before = hvd.counters()
    for _ in range(5):
        steady()
    d = delta(before, hvd.counters())
    assert d["cache_hits"] == (0 if r == 0 else 4), (r, d)

    # The control plane, frame by frame: each cached request is one frame from a worker
    # to rank 0 of a header (16 bytes), the batch's count (4), a tag (1) and the id (4).
    before = hvd.counters()
    for _ in range(4):
        steady()
    d = delta(before, hvd.counters())
    cached = 16 + 4 + 1 + 4
    if r == 0:
        # (What rank 0 received in the window is not exact: a worker that finished may
        # already have asked for its next operation.)
        assert d["control_frames_sent"] == 4 * (n - 1), d
        assert d["control_bytes_sent"] > 4 * (n - 1) * 16, d
    else:
        assert d["control_frames_sent"] == 4 and d["control_bytes_sent"] == 4 * cached, d
        assert d["control_frames_received"] == 4, d
    # What rank 0 wrote is what the workers read.
    assert total(d["control_bytes_received"] if r else 0) == \
        total(d["control_bytes_sent"] if r == 0 else 0), d
    assert d["vote_messages"] == 0 and d["vote_bytes"] == 0, d
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()
