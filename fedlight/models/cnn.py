"""Small convolutional and fully connected models used by the seed papers' experiments."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from fedlight.errors import check


def _check_positive(name: str, value: int) -> None:
    check(isinstance(value, int) and value >= 1, f"`model.{name}` must be a positive integer, got {value!r}")


class MLP(nn.Module):
    """Fully connected network on flattened inputs, ReLU between layers.

    The defaults give the FedAvg paper's "2NN" for 28×28 images: 784-200-200-10 (199,210 parameters).

    Args:
        in_features: Size of the flattened input (784 for 28×28 grayscale images).
        hidden: Widths of the hidden layers, in order; empty for a linear model.
        num_classes: Number of output logits.
    """

    def __init__(
        self, in_features: int = 784, hidden: tuple[int, ...] | list[int] = (200, 200), num_classes: int = 10
    ) -> None:
        super().__init__()
        _check_positive("in_features", in_features)
        _check_positive("num_classes", num_classes)
        check(
            all(isinstance(h, int) and h >= 1 for h in hidden),
            f"`model.hidden` must hold positive integers, got {list(hidden)!r}",
        )
        widths = [in_features, *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class LeNet5(nn.Module):
    """LeNet-5 as used in the seed papers' code: two 5×5 convolutions with 64 channels and three FC layers.

    conv(in→64, 5) → ReLU → maxpool 2 → conv(64→64, 5) → ReLU → maxpool 2 → FC →384 → ReLU → 192 → ReLU →
    num_classes. Returns raw logits (one of the authors' copies ends in log_softmax; that is redundant before
    cross-entropy and left out here). The flattened size follows from ``input_size``: 1600 for 32, 1024 for 28.

    Args:
        in_channels: Image channels (3 for CIFAR, 1 for (Fashion-)MNIST).
        num_classes: Number of output logits.
        input_size: Side of the square input image in pixels; at least 16.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, input_size: int = 32) -> None:
        super().__init__()
        _check_positive("in_channels", in_channels)
        _check_positive("num_classes", num_classes)
        check(
            isinstance(input_size, int) and input_size >= 16,
            f"`model.input_size` must be an integer of at least 16, got {input_size!r}",
        )
        side = ((input_size - 4) // 2 - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 384),
            nn.ReLU(),
            nn.Linear(384, 192),
            nn.ReLU(),
            nn.Linear(192, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class VGG11(nn.Module):
    """VGG-11 without BatchNorm, following the seed papers' VGG-11.

    Conv blocks 64 | 128 | 256×2 | 512×2 | 512×2 (3×3, padding 1, ReLU), a 2×2 max-pool after each block, then a
    two-layer head: 512→100→num_classes when ``num_classes`` ≤ 10, else 512→256→num_classes. Returns raw logits.
    Meant for 32×32 inputs; an adaptive average pool before the head (a no-op at 32×32) accepts larger ones.

    Args:
        num_classes: Number of output logits.
        in_channels: Image channels.
    """

    blocks: tuple[tuple[int, ...], ...] = ((64,), (128,), (256, 256), (512, 512), (512, 512))

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        _check_positive("num_classes", num_classes)
        _check_positive("in_channels", in_channels)
        layers: list[nn.Module] = []
        c = in_channels
        for block in self.blocks:
            for width in block:
                layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU()]
                c = width
            layers.append(nn.MaxPool2d(2))
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        hidden = 100 if num_classes <= 10 else 256
        self.classifier = nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class SmallCNN(nn.Module):
    """A tiny CNN with normalization layers, for contract tests and quick experiments.

    conv 3×3 → norm → ReLU → maxpool 2 → conv 3×3 → norm → ReLU → global average pool → linear. About 1.5k
    parameters at the defaults; any input size of at least 2×2 works.

    Args:
        in_channels: Image channels.
        num_classes: Number of output logits.
        width: Channels of the first conv; the second has twice as many.
        norm: "batch" (BatchNorm2d, which has running-statistics buffers), "group" (GroupNorm with 2 groups when
            the channel count is even, else 1) or "none".
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        width: int = 8,
        norm: Literal["batch", "group", "none"] = "batch",
    ) -> None:
        super().__init__()
        _check_positive("in_channels", in_channels)
        _check_positive("num_classes", num_classes)
        _check_positive("width", width)
        check(norm in ("batch", "group", "none"), f"`model.norm` must be 'batch', 'group' or 'none', got {norm!r}")

        def make_norm(c: int) -> nn.Module:
            if norm == "batch":
                return nn.BatchNorm2d(c)
            if norm == "group":
                return nn.GroupNorm(2 if c % 2 == 0 else 1, c)
            return nn.Identity()

        self.net = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            make_norm(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            make_norm(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * width, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
