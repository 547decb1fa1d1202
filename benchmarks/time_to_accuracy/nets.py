"""The tasks' networks as plain ``nn.Module``\\ s, for workers that start without Lightning: the
recipes' own builders (:mod:`recipes.plain`), so the same seed gives the recipes' weights."""

from __future__ import annotations

import torch
from torch import nn

from recipes.plain import add_lstm_layers, lstm_forward, resnet_cifar

__all__ = ["LanguageModel", "resnet_cifar"]


class LanguageModel(nn.Module):
    """``recipes.language.LSTMLanguageModel``'s network (embedding, LSTM, decoder tied to the
    embedding) without the LightningModule around it."""

    def __init__(self, vocab_size: int, size: int, num_layers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        add_lstm_layers(self, vocab_size, size, size, num_layers, dropout, tie=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lstm_forward(self, tokens)
