"""The models of the synthetic benchmarks: a torchvision model by name when torchvision
is installed, or ``small-resnet``, a residual network defined here that runs on CPUs in
seconds."""

import torch
import torch.nn.functional as F


class Residual(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.b = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.na, self.nb = torch.nn.BatchNorm2d(width), torch.nn.BatchNorm2d(width)

    def forward(self, x):
        return F.relu(x + self.nb(self.b(F.relu(self.na(self.a(x))))))


def small_resnet(classes=1000, width=32):
    """Stem, two stages of two residual blocks, global pooling and a classifier."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False),
        torch.nn.BatchNorm2d(width), torch.nn.ReLU(),
        Residual(width), Residual(width),
        torch.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
        torch.nn.BatchNorm2d(2 * width), torch.nn.ReLU(),
        Residual(2 * width), Residual(2 * width),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2 * width, classes))


def build_model(name):
    if name == "small-resnet":
        return small_resnet()
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f"--model {name} needs torchvision; without it use small-resnet")
    return getattr(models, name)()


def synthetic_batch(batch_size, image_size, device):
    """One batch of random images and labels (1000 classes), reused at every step."""
    data = torch.randn(batch_size, 3, image_size, image_size, device=device)
    target = torch.randint(0, 1000, (batch_size,), device=device)
    return data, target
