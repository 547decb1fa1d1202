"""Word-level language modelling on Penn Treebank (Mikolov's preprocessed text files).

The corpus is ``ptb.{train,valid,test}.txt`` (one sentence per line, 10k-word vocabulary with
``<unk>`` already in place). Each line ends with an ``<eos>`` token; the token stream is cut into
consecutive windows of ``bptt + 1`` tokens, and a sample is (window[:-1], window[1:]). Windows are
independent (the hidden state is not carried between batches, so DDP may shard them freely).
Perplexity = exp(mean token cross-entropy).
"""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics.text import Perplexity

from lightning_gc.common.validation import check_int, check_range
from recipes.common import RecipeDataModule, RecipeTask, SyntheticDataset, dataset_missing, fetching
from recipes.plain import add_lstm_layers, lstm_forward

PTB_SPLITS = {"train": "ptb.train.txt", "valid": "ptb.valid.txt", "test": "ptb.test.txt"}
PTB_URL = "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz"
EOS = "<eos>"


def read_tokens(path: Path) -> list[str]:
    """The whitespace-separated words of ``path``, each line followed by ``<eos>``."""
    with open(path, encoding="utf-8") as f:
        return [word for line in f for word in [*line.split(), EOS]]


def build_vocab(tokens: list[str]) -> dict[str, int]:
    """Word -> id in order of first appearance (deterministic, identical on every rank)."""
    return {word: i for i, word in enumerate(dict.fromkeys(tokens))}


def windows(ids: torch.Tensor, bptt: int) -> TensorDataset:
    """Consecutive (input, target) windows of ``bptt`` tokens; targets are inputs shifted by one."""
    n = (len(ids) - 1) // bptt
    x = ids[: n * bptt].view(n, bptt)
    y = ids[1 : n * bptt + 1].view(n, bptt)
    return TensorDataset(x, y)


def safe_extract(archive: tarfile.TarFile, destination: Path) -> None:
    """Extract ``archive`` into ``destination``, refusing members that would land outside it or
    are links/devices (``filter="data"`` where this Python has it: 3.10.12+, 3.11.4+)."""
    if hasattr(tarfile, "data_filter"):
        archive.extractall(destination, filter="data")
        return
    root = destination.resolve()
    for member in archive.getmembers():
        target = (destination / member.name).resolve()
        if not (member.isfile() or member.isdir()) or (target != root and root not in target.parents):
            raise ValueError(f"refusing to extract {member.name!r} from {archive.name}: not a plain file inside it")
    archive.extractall(destination)


class PTBDataModule(RecipeDataModule):
    """Penn Treebank from ``<root>/ptb.{train,valid,test}.txt`` (the test text only for a test
    stage); downloaded (Mikolov's simple-examples.tgz) when ``download=true`` and any is missing.

    Args:
        root: directory holding the text files (``data.root``).
        batch_size: per-process number of windows per batch.
        bptt: window length in tokens.
        vocab_size: vocabulary of the synthetic data (the real one is read from the train file).
        synthetic, synthetic_size: made-up token windows instead of files, and how many.
    """

    def __init__(
        self,
        root: str = "data/ptb",
        batch_size: int = 20,
        bptt: int = 35,
        download: bool = False,
        vocab_size: int = 10_000,
        synthetic: bool = False,
        synthetic_size: int = 512,
    ) -> None:
        super().__init__(root, batch_size, num_workers=0, synthetic=synthetic, synthetic_size=synthetic_size)
        self.bptt = check_int("data.bptt", bptt, 1)
        self.download = bool(download)
        self.vocab_size = check_int("data.vocab_size", vocab_size, 2)
        self.vocab: dict[str, int] | None = None

    def prepare_data(self) -> None:
        if self.synthetic or not self.download or all((self.root / name).is_file() for name in PTB_SPLITS.values()):
            return
        import shutil
        import tempfile

        from torchvision.datasets.utils import download_url

        with tempfile.TemporaryDirectory() as tmp:
            with fetching("Penn Treebank", PTB_URL, self.root):
                download_url(PTB_URL, tmp)
            with tarfile.open(Path(tmp) / Path(PTB_URL).name) as archive:
                safe_extract(archive, Path(tmp))
            self.root.mkdir(parents=True, exist_ok=True)
            for name in PTB_SPLITS.values():
                shutil.copy(Path(tmp) / "simple-examples" / "data" / name, self.root / name)

    def _path(self, split: str) -> Path:
        path = self.root / PTB_SPLITS[split]
        if not path.is_file():
            raise dataset_missing(
                "Penn Treebank",
                self.root,
                " and ".join(PTB_SPLITS.values()),
                f"Set data.download=true, or take them from data/ of {PTB_URL}.",
            )
        return path

    def check_data(self, test: bool = False) -> None:
        """Raise a clear error now (before any process starts) unless the data is synthetic, will be
        downloaded, or is there (``test``: the test split too)."""
        if not (self.synthetic or self.download):
            for split in ("train", "valid", "test") if test else ("train", "valid"):
                self._path(split)

    def setup(self, stage: str | None = None) -> None:
        if self.synthetic:
            vocab, bptt = self.vocab_size, self.bptt

            def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
                ids = torch.randint(vocab, (bptt + 1,), generator=g)
                return ids[:-1], ids[1:]

            self.train_set: Dataset = SyntheticDataset(self.synthetic_size, make, seed=0)
            self.val_set: Dataset = SyntheticDataset(max(1, self.synthetic_size // 4), make, seed=1)
            self.test_set: Dataset = SyntheticDataset(max(1, self.synthetic_size // 4), make, seed=2)
            return
        train_tokens = read_tokens(self._path("train"))
        self.vocab = build_vocab(train_tokens)
        self.vocab_size = len(self.vocab)
        self.train_set = windows(torch.tensor([self.vocab[w] for w in train_tokens]), self.bptt)
        self.val_set = self._held_out("valid")
        if stage == "test":
            self.test_set = self._held_out("test")

    def _held_out(self, split: str) -> TensorDataset:
        """The ``valid`` or ``test`` text as windows, in the training vocabulary."""
        assert self.vocab is not None
        tokens = read_tokens(self._path(split))
        unknown = sorted({w for w in tokens if w not in self.vocab})
        if unknown:
            raise ValueError(f"{PTB_SPLITS[split]} has words missing from {PTB_SPLITS['train']}: {unknown[:5]}")
        return windows(torch.tensor([self.vocab[w] for w in tokens]), self.bptt)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)


class _LanguageModel(RecipeTask):
    """Base of the language models: next-token cross-entropy, validation perplexity ``val/ppl``
    (lower is better), and a check that the model's vocabulary is the corpus's."""

    metric_name = "val/ppl"
    test_metric_name = "test/ppl"
    metric_mode = "min"

    def __init__(self, vocab_size: int, **optim: Any) -> None:
        super().__init__(**optim)
        check_int("model.vocab_size", vocab_size, 2)
        self.val_ppl = Perplexity()
        self.test_ppl = Perplexity()

    def setup(self, stage: str) -> None:
        data_vocab = getattr(self.trainer.datamodule, "vocab_size", None)
        if data_vocab is not None and data_vocab != self.hparams.vocab_size:
            raise ValueError(
                f"`model.vocab_size={self.hparams.vocab_size}` but the corpus has {data_vocab} words; "
                f"set model.vocab_size={data_vocab} (or data.vocab_size for synthetic data)"
            )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_ppl(self(x), y)
        self.log("val/ppl", self.val_ppl, prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_ppl(self(x), y)
        self.log("test/ppl", self.test_ppl, sync_dist=True)


class LSTMLanguageModel(_LanguageModel):
    """Embedding -> ``num_layers`` LSTM -> linear decoder (weights tied to the embedding when
    ``tie_weights`` and sizes match), dropout between layers (Zaremba et al. 2014; Press & Wolf 2017).
    """

    def __init__(
        self,
        vocab_size: int = 10_000,
        embedding_size: int = 1500,
        hidden_size: int = 1500,
        num_layers: int = 2,
        dropout: float = 0.65,
        tie_weights: bool = True,
        **optim: Any,
    ) -> None:
        super().__init__(vocab_size, **optim)
        check_int("model.num_layers", num_layers, 1)
        check_range("model.dropout", dropout, 0.0, 1.0, high_inclusive=False)
        self.save_hyperparameters()
        add_lstm_layers(self, vocab_size, embedding_size, hidden_size, num_layers, dropout, tie_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lstm_forward(self, tokens)


class TransformerLanguageModel(_LanguageModel):
    """A causal (GPT-style) transformer: token and learned position embeddings, ``num_layers``
    pre-norm self-attention blocks under a causal mask, a final LayerNorm and a decoder tied to
    the token embedding. Trained with AdamW in the recipes (``model.optimizer=adamw``).
    """

    def __init__(
        self,
        vocab_size: int = 10_000,
        d_model: int = 256,
        num_heads: int = 4,
        num_layers: int = 4,
        ff_size: int = 1024,
        dropout: float = 0.1,
        max_length: int = 256,
        **optim: Any,
    ) -> None:
        super().__init__(vocab_size, **optim)
        check_int("model.d_model", d_model, 1)
        check_int("model.num_heads", num_heads, 1)
        if d_model % num_heads:
            raise ValueError(f"`model.d_model={d_model}` must be a multiple of model.num_heads={num_heads}")
        check_int("model.num_layers", num_layers, 1)
        check_int("model.ff_size", ff_size, 1)
        check_range("model.dropout", dropout, 0.0, 1.0, high_inclusive=False)
        check_int("model.max_length", max_length, 1)
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_length, d_model)
        self.drop = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(d_model, num_heads, ff_size, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.decoder = nn.Linear(d_model, vocab_size, bias=False)
        self.decoder.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.hparams.max_length:
            raise ValueError(f"windows of {length} tokens exceed model.max_length={self.hparams.max_length}")
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.drop(self.embed(tokens) + self.position(torch.arange(length, device=tokens.device)))
        return self.decoder(self.norm(self.blocks(hidden, mask=mask, is_causal=True)))
