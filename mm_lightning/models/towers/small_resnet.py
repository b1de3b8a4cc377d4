"""A narrow ResNet for small images on CPU: the demo's image tower (``TorchvisionTower(name="resnet_custom")``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torchvision.models.resnet import BasicBlock, conv1x1


class SmallResNet(nn.Sequential):
    """A narrow ResNet of torchvision ``BasicBlock``s for small images on CPU (``ResNet`` hard-codes 64..512).

    Args:
        widths: channels per stage; each stage after the first halves the resolution.
        layers: number of ``BasicBlock`` per stage (default: one per stage).
        stem_stride: stride of the stem convolution; above 2 a patchify convolution (kernel = stride)."""

    def __init__(
        self,
        widths: Sequence[int] = (32, 64, 128, 256),
        layers: Sequence[int] | None = None,
        stem_stride: int = 2,
    ) -> None:
        layers = [1] * len(widths) if layers is None else layers
        if len(widths) != len(layers):
            raise ValueError(f"widths {list(widths)} and layers {list(layers)} must have the same length")
        kernel, padding = (3, 1) if stem_stride <= 2 else (stem_stride, 0)
        modules: list[nn.Module] = [
            nn.Sequential(
                nn.Conv2d(3, widths[0], kernel, stride=stem_stride, padding=padding, bias=False),
                nn.BatchNorm2d(widths[0]),
                nn.ReLU(inplace=True),
            )
        ]
        in_ch = widths[0]
        for i, (width, n_blocks) in enumerate(zip(widths, layers, strict=True)):
            stride = 1 if i == 0 else 2
            downsample = None
            if stride != 1 or in_ch != width:
                downsample = nn.Sequential(conv1x1(in_ch, width, stride), nn.BatchNorm2d(width))
            blocks = [BasicBlock(in_ch, width, stride, downsample)]
            blocks += [BasicBlock(width, width) for _ in range(n_blocks - 1)]
            modules.append(nn.Sequential(*blocks))
            in_ch = width
        super().__init__(*modules)
        self.out_channels = in_ch
