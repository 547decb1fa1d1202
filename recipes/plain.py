"""The recipes' pieces that need nothing but torch (no Lightning, torchmetrics or torchvision), so
that benchmark workers starting dozens of processes build exactly the recipes' networks and
schedule without paying seconds of imports: the CIFAR ResNet, the PTB LSTM's layers, the
learning-rate warm-up.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import nn

from lightning_gc.common.validation import check_int, check_range


class WarmupMultiStep:
    """Learning-rate factor per optimizer step: linear warm-up, then step decay.

    With ``e = step / steps_per_epoch`` (fractional epochs):
    ``factor(e) = start + (1 - start) * e / warmup_epochs`` while ``e < warmup_epochs`` (Goyal et al.
    2017's gradual warm-up), afterwards ``gamma ** (number of milestones <= e)``. ``factor`` is
    1 at the end of the warm-up and never exceeds 1.

    ``steps_per_epoch`` may be ``None`` until the first step after step 0: the recipes set it at
    ``on_train_start``, when the fit loop has loaded the training data (with ``max_epochs=-1``
    Lightning does not load them to configure the optimizers). Without a warm-up or milestones the
    factor is 1 and the epoch length is never read. Every attribute is plain data, because
    ``LambdaLR`` saves a callable object's ``__dict__`` in checkpoints.
    """

    def __init__(
        self,
        steps_per_epoch: int | None,
        warmup_epochs: float = 0.0,
        milestones: Sequence[float] = (),
        gamma: float = 0.1,
        start: float = 0.1,
    ) -> None:
        self.steps_per_epoch = None if steps_per_epoch is None else check_int("steps_per_epoch", steps_per_epoch, 1)
        self.warmup_epochs = check_range("warmup_epochs", warmup_epochs, 0.0)
        self.milestones = sorted(check_range("milestones[]", m, 0.0) for m in milestones)
        self.gamma = check_range("gamma", gamma, 0.0, 1.0, low_inclusive=False)
        self.start = check_range("start", start, 0.0, 1.0)

    def __call__(self, step: int) -> float:
        if not self.warmup_epochs and not self.milestones:
            return 1.0
        if step == 0:
            epoch = 0.0
        elif self.steps_per_epoch is None:
            raise RuntimeError("WarmupMultiStep stepped past step 0 before its steps_per_epoch was set")
        else:
            epoch = step / self.steps_per_epoch
        if epoch < self.warmup_epochs:
            return self.start + (1.0 - self.start) * epoch / self.warmup_epochs
        return self.gamma ** bisect.bisect_right(self.milestones, epoch)


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``, module for module (same attribute names, so the same state_dict
    keys and, from the same seed, the same weights): two 3x3 convolutions with batch norms and the
    shortcut."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class PadShortcut(nn.Module):
    """He et al.'s option-A shortcut: subsample by 2 and zero-pad the new channels (no parameters)."""

    def __init__(self, extra_channels: int) -> None:
        super().__init__()
        self.extra = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, ::2, ::2]
        return nn.functional.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))


def resnet_cifar(depth: int, num_classes: int = 10) -> nn.Sequential:
    """The CIFAR ResNet of ``depth = 6n + 2`` layers: 3 stages of n :class:`BasicBlock`\\ s
    with 16, 32, 64 channels; ResNet-20 has 0.27 M parameters, ResNet-110 1.7 M."""
    if (depth - 2) % 6 != 0 or depth < 8:
        raise ValueError(f"`depth` of a CIFAR ResNet must be 6n+2 >= 8 (20, 32, 44, 56, 110, ...), got {depth}")
    n = (depth - 2) // 6
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
    channels = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(n):
            stride = 2 if stage > 0 and block == 0 else 1
            down = PadShortcut(width - channels) if stride == 2 else None
            layers.append(BasicBlock(channels, width, stride=stride, downsample=down))
            channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    net = nn.Sequential(*layers)
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight)
    return net


def add_lstm_layers(
    module: nn.Module,
    vocab_size: int,
    embedding_size: int,
    hidden_size: int,
    num_layers: int,
    dropout: float,
    tie: bool,
) -> None:
    """Give ``module`` the PTB LSTM's layers (Zaremba et al. 2014; Press & Wolf 2017): ``embed``,
    ``drop``, ``lstm``, ``decoder`` (its weight tied to the embedding's when ``tie``), the embedding
    drawn uniformly from [-0.1, 0.1]; :func:`lstm_forward` runs them."""
    module.embed = nn.Embedding(vocab_size, embedding_size)
    module.drop = nn.Dropout(dropout)
    module.lstm = nn.LSTM(embedding_size, hidden_size, num_layers, dropout=dropout, batch_first=True)
    module.decoder = nn.Linear(hidden_size, vocab_size)
    if tie:
        if embedding_size != hidden_size:
            raise ValueError(
                f"`model.tie_weights=true` needs embedding_size == hidden_size, got {embedding_size} and {hidden_size}"
            )
        module.decoder.weight = module.embed.weight
    nn.init.uniform_(module.embed.weight, -0.1, 0.1)


def lstm_forward(module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the layers :func:`add_lstm_layers` gave ``module``, for ``tokens`` (batch, time)."""
    out, _ = module.lstm(module.drop(module.embed(tokens)))
    return module.decoder(module.drop(out))
