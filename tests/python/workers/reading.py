"""Whatever PERSEUS_SHM_DIRECT's check at init decided, large blocks between ranks of one
host arrive right; the counters show which way they went, and the worker prints it."""

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    nbytes = 4 << 20  # read on 2 and 3 ranks where reading is on (2 MiB to 32 MiB)
    x = torch.arange(nbytes // 4, dtype=torch.float32) % 1009
    before = hvd.counters()["bytes_intra_host"]
    got = hvd.allreduce(x + r, op=hvd.Sum, name="reading.sum")
    moved = hvd.counters()["bytes_intra_host"] - before
    close(got, x * n + n * (n - 1) / 2, "large allreduce")
    # The ring sends about 2(n-1)/n of the buffer from every rank (its chunks are
    # whole elements); reading sends offers only.
    ring = 2 * (n - 1) * nbytes // n
    assert abs(moved - ring) < 64 or moved < 4096, (moved, ring)
    print(f"rank {r} path {'read' if moved < 4096 else 'ring'}", flush=True)
    blocks = [x[: 1 << 18] + i for i in range(n)]  # 1 MiB a rank, stacked by default
    close(hvd.allgather(blocks[r], name="reading.gather"), torch.stack(blocks), "allgather")
    close(hvd.broadcast(x + r, n - 1, name="reading.bcast"), x + n - 1, "broadcast")
    done(r)


if __name__ == "__main__":
    main()
