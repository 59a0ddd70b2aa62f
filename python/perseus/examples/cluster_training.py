"""The training function the Ray and Spark examples run on every rank: a Horovod-style
PyTorch loop (``hvd.init()``, ``DistributedOptimizer``, the initial state broadcast)
training a small CNN on this rank's shard of the synthetic MNIST-like data of
``synthetic_mnist.py``. It returns the final loss averaged over the ranks."""


def train(epochs, batch_size):
    import perseus.torch.horovod as hvd
    import torch
    import torch.nn.functional as F
    from synthetic_mnist import load

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    x, y = load(1024, seed=0)
    images = torch.from_numpy(x[hvd.rank()::hvd.size()]).permute(0, 3, 1, 2).contiguous()
    labels = torch.from_numpy(y[hvd.rank()::hvd.size()])
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(8 * 13 * 13, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size()),
        named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for _ in range(epochs):
        for i in range(0, len(images), batch_size):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images[i:i + batch_size]), labels[i:i + batch_size])
            loss.backward()
            optimizer.step()
    return hvd.allreduce(loss.detach(), name="final_loss").item()
