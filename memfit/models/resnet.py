"""A small ResNet for 32x32 images, the convolutional reference model.

The defaults are the classic CIFAR ResNet-20 layout: widths 16, 32, 64, three blocks each.

Stem (3x3 conv → BatchNorm → ReLU), then ``stages``: an ``nn.Sequential`` of stages, each an
``nn.Sequential`` of residual :class:`BasicBlock` s (every stage after the first halves the
resolution in its first block), then global average pooling and a linear head. Each block
and each stage is a natural checkpoint unit.

Example::

    model = ResNet(ResNetConfig())
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    resnet_loss(model, (images, labels)).backward()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import ConfigError
from memfit.models.config_checks import check_positive_ints


@dataclass
class ResNetConfig:
    """Shape of a :class:`ResNet`.

    Example::

        cfg = ResNetConfig(widths=(64, 128, 256, 512), blocks_per_stage=(2, 2, 2, 2))
    """

    num_classes: int = 10
    """Number of output classes."""
    in_channels: int = 3
    """Channels of the input images."""
    image_size: int = 32
    """Height and width of the input images (the network itself accepts any size)."""
    widths: tuple[int, ...] = (16, 32, 64)
    """Channels of each stage; the stem outputs ``widths[0]``."""
    blocks_per_stage: tuple[int, ...] = (3, 3, 3)
    """Number of :class:`BasicBlock` s in each stage; same length as ``widths``."""
    zero_init_residual: bool = True
    """Start each block's last BatchNorm scale at 0, so every block begins as the identity."""

    def __post_init__(self) -> None:
        self.widths = tuple(self.widths)
        self.blocks_per_stage = tuple(self.blocks_per_stage)
        check_positive_ints(self, ("num_classes", "in_channels", "image_size"))
        if not self.widths or len(self.widths) != len(self.blocks_per_stage):
            raise ConfigError(
                "ResNetConfig.widths and blocks_per_stage must be non-empty and of equal length, "
                f"got {self.widths} and {self.blocks_per_stage}"
            )
        if min(self.widths) <= 0 or min(self.blocks_per_stage) <= 0:
            raise ConfigError(
                f"ResNetConfig widths and block counts must be positive, got {self.widths} "
                f"and {self.blocks_per_stage}"
            )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection.

    When the block changes resolution or width, the shortcut is a strided 1x1 convolution
    with BatchNorm; otherwise it is the identity.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride != 1 or in_channels != out_channels:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Out-of-place ReLUs: an in-place one would overwrite a tensor autograd saved, which
        # confuses memory accounting and breaks under some recompute schemes.
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet-style image classifier: ``forward(images) -> logits``.

    Example::

        model = ResNet(ResNetConfig(num_classes=100))
        model(torch.randn(2, 3, 32, 32)).shape  # torch.Size([2, 100])
    """

    def __init__(self, config: ResNetConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or ResNetConfig()
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, config.widths[0], 3, 1, padding=1, bias=False),
            nn.BatchNorm2d(config.widths[0]),
            nn.ReLU(),
        )
        stages = []
        in_ch = config.widths[0]
        for i, (width, n_blocks) in enumerate(zip(config.widths, config.blocks_per_stage)):
            stride = 1 if i == 0 else 2
            blocks = [BasicBlock(in_ch, width, stride)]
            blocks += [BasicBlock(width, width) for _ in range(n_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            in_ch = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_ch, config.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming-normal convolutions, unit BatchNorm, and (optionally) zero residual BN."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.01)
                nn.init.zeros_(module.bias)
        if self.config.zero_init_residual:
            for module in self.modules():
                if isinstance(module, BasicBlock):
                    nn.init.zeros_(module.bn2.weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for images ``(B, in_channels, H, W)``."""
        x = self.stages(self.stem(images))
        return self.head(torch.flatten(self.pool(x), 1))

    def num_params(self) -> int:
        """Number of parameters.

        Example::

            ResNet(ResNetConfig()).num_params()
        """
        return sum(p.numel() for p in self.parameters())


def resnet_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of a classifier on ``batch = (images, labels)``, computed in fp32.

    Example::

        loss = resnet_loss(model, image_batch(32, generator=0))
    """
    images, labels = batch
    return F.cross_entropy(model(images).float(), labels)
