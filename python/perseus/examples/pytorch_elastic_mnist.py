"""Elastic Horovod-style training of the CNN of pytorch_mnist.py (docs/elastic.md).

    perseusrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/pytorch_elastic_mnist.py --epochs 3

Workers may fail or join while it trains: ``hvd.elastic.run`` re-forms the ranks, the
state (model, optimizer, data sampler, epoch and batch) goes back to its last commit
after a failure, and rank 0's state reaches workers that join. The learning rate
follows the number of ranks. Run without the elastic flags (``perseusrun -np 2``) it
trains as any job.
"""

import os
import time

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from pytorch_mnist import Net, class_patterns, evaluate, parse_args, synthetic_mnist


def main():
    args = parse_args(__doc__.split("\n")[0])
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

    patterns = class_patterns(torch.Generator().manual_seed(args.seed))
    train = torch.utils.data.TensorDataset(*synthetic_mnist(args.train_size, args.seed + 1,
                                                            patterns))
    test_x, test_y = synthetic_mnist(args.test_size, args.seed + 2, patterns)
    sampler = hvd.elastic.ElasticSampler(train, seed=args.seed)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def scale_lr():  # after each reset: Horovod's rule for the new number of ranks
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=1, batch=0)
    state.register_reset_callbacks([scale_lr])

    @hvd.elastic.run
    def train_epochs(state):
        while state.epoch <= args.epochs:
            start = time.time()
            model.train()
            # the sampler gives what this epoch has left, split among the current ranks
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                sampler.record_batch(i, args.batch_size)
                state.batch += 1
                if state.batch % 10 == 0:
                    state.commit()
            loss, accuracy = evaluate(model, test_x, test_y, 256)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: test loss {loss:.4f} accuracy {accuracy:.4f} "
                      f"({time.time() - start:.1f} s, size {hvd.size()})", flush=True)
            state.epoch, state.batch = state.epoch + 1, 0
            sampler.set_epoch(state.epoch)
            state.commit()
        return loss, accuracy

    loss, accuracy = train_epochs(state)
    if hvd.rank() == 0:
        print(f"final loss {loss:.4f} accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
