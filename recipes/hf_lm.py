"""A Hugging Face causal language model as a recipe model: GPT-2 built from a config, never downloaded.

The model is ``transformers.GPT2LMHeadModel(GPT2Config(...))``, randomly initialised as Hugging
Face initialises it (normal(0, 0.02) weights, residual projections scaled by 1 / sqrt(2 n_layer),
decoder tied to the token embedding). :class:`recipes.language._LanguageModel` does the rest, as
for the recipes' own transformer: next-token cross-entropy on the PTB windows, validation and test
perplexity exp(mean token cross-entropy), AdamW with the recipes' schedule. It is a model the
compression recipes were not tuned on (the Adam hand-over's second client, benchmarks/accuracy.py
``gpt2_ptb_adamw``).

``transformers`` is an optional dependency of this recipe only (``pip install transformers``):
it is imported when the model is built, never by ``lightning_gc``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_gc.common.validation import check_int, check_range
from recipes.language import _LanguageModel


class GPT2LanguageModel(_LanguageModel):
    """Hugging Face's GPT-2 (``GPT2LMHeadModel``) of the given size; ``forward`` maps token ids
    ``(batch, length)`` to next-token logits ``(batch, length, vocab_size)``.

    Args:
        vocab_size: the corpus's vocabulary (``${data.vocab_size}``; PTB: 10,000).
        n_layer, n_embd, n_head: GPT-2's depth, width and attention heads (``n_embd`` a multiple of
            ``n_head``); the feed-forward width is GPT-2's 4 x ``n_embd``.
        n_positions: learned positions, the longest window it takes (``${data.bptt}``).
        dropout: GPT-2's residual, embedding and attention dropout (its 0.1 by default).
        **optim: :class:`recipes.common.RecipeTask`'s optimizer arguments.

    Raises:
        ValueError: a size out of range, or ``n_embd`` not a multiple of ``n_head``.
        ModuleNotFoundError: ``transformers`` is not installed.
    """

    def __init__(
        self,
        vocab_size: int = 10_000,
        n_layer: int = 2,
        n_embd: int = 128,
        n_head: int = 4,
        n_positions: int = 64,
        dropout: float = 0.1,
        **optim: Any,
    ) -> None:
        super().__init__(vocab_size, **optim)
        check_int("model.n_layer", n_layer, 1)
        check_int("model.n_embd", n_embd, 1)
        check_int("model.n_head", n_head, 1)
        if n_embd % n_head:
            raise ValueError(f"`model.n_embd={n_embd}` must be a multiple of model.n_head={n_head}")
        check_int("model.n_positions", n_positions, 1)
        check_range("model.dropout", dropout, 0.0, 1.0, high_inclusive=False)
        self.save_hyperparameters()
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                f"model {type(self).__name__} needs Hugging Face transformers ({err}): pip install transformers"
            ) from err
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=n_positions,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            use_cache=False,  # training only: no key/value cache
            bos_token_id=None,  # GPT-2's 50256 is not a PTB word, and nothing here generates text
            eos_token_id=None,
        )
        self.model = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.hparams.n_positions:
            raise ValueError(f"windows of {length} tokens exceed model.n_positions={self.hparams.n_positions}")
        return self.model(input_ids=tokens).logits
