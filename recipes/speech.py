"""Speech recognition: LibriSpeech (and the yesno corpus) with a DeepSpeech-style CTC model.

Features: log-mel spectrogram, ``log(1e-6 + |STFT|^2 @ mel_filterbank)`` with a 20 ms Hann window
and 10 ms hop, normalised per utterance to zero mean and unit variance per mel band.
Transcripts are upper-case letters, space and apostrophe; class 0 is CTC's blank.
WER = word-level edit distance / reference words (torchmetrics), from greedy CTC decoding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from torchmetrics.text import WordErrorRate

from lightning_gc.common.validation import check_choice, check_int
from recipes.common import RecipeDataModule, RecipeTask, SyntheticDataset, dataset_missing, fetching

ALPHABET = "_ '" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""Output classes: ``_`` is the CTC blank (class 0)."""
LIBRISPEECH_URL = "https://www.openslr.org/resources/12/{subset}.tar.gz"
YESNO_WORDS = {"0": "NO", "1": "YES"}


def encode_text(text: str) -> torch.Tensor:
    """Class ids of the characters of ``text`` (upper-cased); other characters are an error."""
    text = text.upper()
    bad = sorted(set(text) - set(ALPHABET[1:]))
    if bad:
        raise ValueError(f"transcript has characters outside {ALPHABET[1:]!r}: {bad}")
    return torch.tensor([ALPHABET.index(c) for c in text], dtype=torch.long)


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """Best-path CTC decoding of ``(batch, time, classes)``: argmax, merge repeats, drop blanks."""
    out = []
    for best, n in zip(log_probs.argmax(-1), lengths.tolist()):
        ids = torch.unique_consecutive(best[:n]).tolist()
        out.append(" ".join("".join(ALPHABET[i] for i in ids if i != 0).split()))
    return out


def mel_filterbank(n_fft: int, n_mels: int, sample_rate: int) -> torch.Tensor:
    """``(n_fft // 2 + 1, n_mels)`` triangular filters evenly spaced on the HTK mel scale
    ``mel(f) = 2595 log10(1 + f / 700)`` between 0 Hz and Nyquist."""

    def mel(f: torch.Tensor) -> torch.Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)

    def hz(m: torch.Tensor) -> torch.Tensor:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = hz(torch.linspace(0.0, float(mel(torch.tensor(sample_rate / 2.0))), n_mels + 2))
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (freqs[:, None] - lower) / (centre - lower)
    falling = (upper - freqs[:, None]) / (upper - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


def log_mel(wave: torch.Tensor, sample_rate: int, n_mels: int) -> torch.Tensor:
    """``(frames, n_mels)`` normalised log-mel features of a mono waveform (see module docstring)."""
    win, hop = int(0.02 * sample_rate), int(0.01 * sample_rate)
    n_fft = 2 ** math.ceil(math.log2(win))
    spec = torch.stft(wave, n_fft, hop, win, torch.hann_window(win), return_complex=True).abs().pow(2)
    feats = torch.log(1e-6 + spec.T @ mel_filterbank(n_fft, n_mels, sample_rate))
    return (feats - feats.mean(0)) / (feats.std(0) + 1e-5)


class AudioTranscripts(Dataset):
    """(features, character ids) of a list of (audio file, transcript) pairs, read with soundfile."""

    def __init__(self, items: list[tuple[Path, str]], n_mels: int) -> None:
        self.items, self.n_mels = items, n_mels

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        import soundfile

        path, text = self.items[index]
        wave, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        return log_mel(torch.from_numpy(wave.mean(1)), rate, self.n_mels), encode_text(text)


def librispeech_items(root: Path, subset: str) -> list[tuple[Path, str]]:
    """(``.flac``, transcript) pairs of ``<root>/LibriSpeech/<subset>/<speaker>/<chapter>/``,
    whose ``<speaker>-<chapter>.trans.txt`` lines read ``<utterance id> <TRANSCRIPT>``."""
    items = []
    for trans in sorted((root / "LibriSpeech" / subset).glob("*/*/*.trans.txt")):
        for line in trans.read_text().splitlines():
            if line.strip():
                utt, text = line.split(" ", 1)
                items.append((trans.parent / f"{utt}.flac", text.strip()))
    return items


def yesno_items(root: Path) -> list[tuple[Path, str]]:
    """(``.wav``, transcript) pairs of the OpenSLR yesno corpus in ``<root>/waves_yesno``: the file
    name is the label sequence, ``0_1_1_...wav`` -> ``NO YES YES ...``."""
    return [
        (wav, " ".join(YESNO_WORDS[c] for c in wav.stem.split("_")))
        for wav in sorted((root / "waves_yesno").glob("*.wav"))
    ]


def pad_batch(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Zero-pad to the longest utterance: (features (B, T, n_mels), feature lengths, targets, target lengths)."""
    feats, targets = zip(*batch)
    lengths = torch.tensor([len(f) for f in feats])
    target_lengths = torch.tensor([len(t) for t in targets])
    padded = nn.utils.rnn.pad_sequence(list(feats), batch_first=True)
    return padded, lengths, nn.utils.rnn.pad_sequence(list(targets), batch_first=True), target_lengths


class SpeechDataModule(RecipeDataModule):
    """LibriSpeech (``corpus="librispeech"``: ``<root>/LibriSpeech/<subset>/...`` with ``.flac`` and
    ``.trans.txt``; subsets downloaded from openslr.org when ``download=true``) or the yesno corpus
    (``corpus="yesno"``: ``<root>/waves_yesno/*.wav``; first 3/4 of files train, rest validate).

    Args:
        root: the corpus directory (``data.root``).
        train_subsets, val_subsets: LibriSpeech subsets, e.g. ``train-clean-100``, ``dev-clean``.
        n_mels: mel bands per frame.
        synthetic, synthetic_size: made-up utterances (``synthetic_frames`` frames, 20-60 letters).
    """

    def __init__(
        self,
        root: str = "data/librispeech",
        corpus: str = "librispeech",
        train_subsets: tuple[str, ...] = ("train-clean-100", "train-clean-360", "train-other-500"),
        val_subsets: tuple[str, ...] = ("dev-clean",),
        batch_size: int = 32,
        num_workers: int = 4,
        n_mels: int = 80,
        download: bool = False,
        synthetic: bool = False,
        synthetic_size: int = 256,
        synthetic_frames: int = 300,
    ) -> None:
        super().__init__(root, batch_size, num_workers, synthetic, synthetic_size)
        self.corpus = check_choice("data.corpus", corpus, ("librispeech", "yesno"))
        self.train_subsets, self.val_subsets = list(train_subsets), list(val_subsets)
        self.n_mels = check_int("data.n_mels", n_mels, 1)
        self.download = bool(download)
        self.synthetic_frames = check_int("data.synthetic_frames", synthetic_frames, 16)

    def prepare_data(self) -> None:
        if self.synthetic or not self.download or self.corpus != "librispeech":
            return
        from torchvision.datasets.utils import download_and_extract_archive

        for subset in self.train_subsets + self.val_subsets:
            if not (self.root / "LibriSpeech" / subset).is_dir():
                url = LIBRISPEECH_URL.format(subset=subset)
                with fetching(f"LibriSpeech {subset}", url, self.root):
                    download_and_extract_archive(url, str(self.root))

    def _items(self, subsets: list[str]) -> list[tuple[Path, str]]:
        items = [item for subset in subsets for item in librispeech_items(self.root, subset)]
        if not items:
            raise dataset_missing(
                "LibriSpeech",
                self.root,
                f"LibriSpeech/<subset>/<speaker>/<chapter>/*.flac + *.trans.txt for subsets {subsets}",
                "Set data.download=true, or fetch and unpack them from https://www.openslr.org/12.",
            )
        return items

    def _yesno_items(self) -> list[tuple[Path, str]]:
        items = yesno_items(self.root)
        if not items:
            raise dataset_missing(
                "yesno", self.root, "waves_yesno/*.wav", "Get it from https://www.openslr.org/1 (4.5 MB)."
            )
        return items

    def check_data(self) -> None:
        """Raise the missing-dataset error now (before any process starts) unless the data is
        synthetic, will be downloaded, or is there."""
        if self.synthetic:
            return
        if self.corpus == "yesno":
            self._yesno_items()
        elif not self.download:
            self._items(self.train_subsets)
            self._items(self.val_subsets)

    def setup(self, stage: str | None = None) -> None:
        if self.synthetic:
            frames, n_mels = self.synthetic_frames, self.n_mels

            def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
                letters = int(torch.randint(20, 61, (), generator=g))
                text = torch.randint(1, len(ALPHABET), (letters,), generator=g)
                return torch.randn(frames, n_mels, generator=g), text

            self.train_set: Dataset = SyntheticDataset(self.synthetic_size, make, seed=0)
            self.val_set: Dataset = SyntheticDataset(max(1, self.synthetic_size // 4), make, seed=1)
        elif self.corpus == "yesno":
            items = self._yesno_items()
            cut = len(items) * 3 // 4
            self.train_set = AudioTranscripts(items[:cut], self.n_mels)
            self.val_set = AudioTranscripts(items[cut:], self.n_mels)
        else:
            self.train_set = AudioTranscripts(self._items(self.train_subsets), self.n_mels)
            self.val_set = AudioTranscripts(self._items(self.val_subsets), self.n_mels)

    def loader_options(self) -> dict[str, Any]:
        return {"collate_fn": pad_batch}


DEEPSPEECH_CONV_KERNELS: tuple[tuple[int, int], ...] = ((11, 41), (11, 21))
"""DeepSpeech 2's (time, frequency) kernel sizes of the two convolutions (``model.conv_kernels``)."""
DEEPSPEECH_CONV_STRIDES: tuple[tuple[int, int], ...] = ((2, 2), (1, 2))
"""DeepSpeech 2's (time, frequency) strides of the two convolutions (``model.conv_strides``)."""


def conv_pairs(name: str, pairs: Sequence[Sequence[int]], *, odd: bool = False) -> tuple[tuple[int, int], ...]:
    """``model.<name>`` checked: two (time, frequency) pairs of integers >= 1, each odd if ``odd``."""
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or len(pairs) != 2:
        raise ValueError(f"`model.{name}` must be two [time, frequency] pairs (one per convolution), got {pairs!r}")
    checked = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"`model.{name}[{i}]` must be a [time, frequency] pair, got {pair!r}")
        for j, size in enumerate(pair):
            check_int(f"model.{name}[{i}][{j}]", size, 1)
            if odd and size % 2 == 0:
                raise ValueError(f"`model.{name}[{i}][{j}]` must be odd, got {size!r}")
        checked.append((int(pair[0]), int(pair[1])))
    return tuple(checked)


class DeepSpeech(RecipeTask):
    """DeepSpeech-style acoustic model (Amodei et al. 2016): two 2-D convolutions over
    (time, frequency) with batch norm and hardtanh, ``rnn_layers`` bidirectional recurrent layers
    (summed directions), a linear layer to the characters, CTC loss.

    Each convolution is padded by half its (odd) kernel, so a stride ``s`` maps ``n`` frames (or
    bands) to ``floor((n - 1) / s) + 1``; with the default strides, ``T' = floor((T - 1) / 2) + 1``
    output frames. Reports validation word error rate ``val/wer`` (lower is better).

    Args:
        n_mels: mel bands per input frame (``data.n_mels``).
        conv_channels: channels of both convolutions.
        rnn_type: ``"gru"`` or ``"lstm"``.
        rnn_layers: bidirectional recurrent layers (>= 1).
        hidden_size: units per direction of each recurrent layer.
        conv_kernels: the two convolutions' (time, frequency) kernel sizes, each odd; the default
            ``((11, 41), (11, 21))`` is DeepSpeech 2's, sized for 80+ mel bands and hours of audio
            (a tiny corpus with ~40 bands trains faster with e.g. ``((5, 5), (5, 5))``).
        conv_strides: the two convolutions' (time, frequency) strides; default ``((2, 2), (1, 2))``
            (DeepSpeech 2's). A larger time stride shortens the sequence the recurrent layers run
            over (their cost on a CPU), as long as ``T'`` stays above the transcript's length.
        **sgd: the optimizer and schedule (:class:`~recipes.common.RecipeTask`).
    """

    metric_name = "val/wer"
    metric_mode = "min"

    def __init__(
        self,
        n_mels: int = 80,
        conv_channels: int = 32,
        rnn_type: str = "gru",
        rnn_layers: int = 5,
        hidden_size: int = 800,
        conv_kernels: Sequence[Sequence[int]] = DEEPSPEECH_CONV_KERNELS,
        conv_strides: Sequence[Sequence[int]] = DEEPSPEECH_CONV_STRIDES,
        **sgd: float,
    ) -> None:
        super().__init__(**sgd)
        check_choice("model.rnn_type", rnn_type, ("gru", "lstm"))
        check_int("model.rnn_layers", rnn_layers, 1)
        check_int("model.conv_channels", conv_channels, 1)
        check_int("model.hidden_size", hidden_size, 1)
        kernels = conv_pairs("conv_kernels", conv_kernels, odd=True)  # odd: half-kernel padding is exact
        strides = conv_pairs("conv_strides", conv_strides)
        self.save_hyperparameters(ignore=["conv_kernels", "conv_strides"])
        # plain lists (not tuples or OmegaConf lists): readable in hparams.yaml and checkpoints
        self.hparams["conv_kernels"] = [list(k) for k in kernels]
        self.hparams["conv_strides"] = [list(s) for s in strides]
        self.time_strides = tuple(s[0] for s in strides)
        c = conv_channels
        layers: list[nn.Module] = []
        for i, (kernel, stride) in enumerate(zip(kernels, strides)):
            padding = (kernel[0] // 2, kernel[1] // 2)
            layers += [
                nn.Conv2d(1 if i == 0 else c, c, kernel, stride=stride, padding=padding),
                nn.BatchNorm2d(c),
                nn.Hardtanh(0, 20, inplace=True),
            ]
        self.conv = nn.Sequential(*layers)
        freq = n_mels
        for _, stride in strides:
            freq = (freq - 1) // stride + 1
        rnn = nn.GRU if rnn_type == "gru" else nn.LSTM
        self.rnn = rnn(c * freq, hidden_size, rnn_layers, batch_first=True, bidirectional=True)
        self.out = nn.Linear(hidden_size, len(ALPHABET))
        self.val_wer = WordErrorRate()

    @staticmethod
    def output_lengths(lengths: torch.Tensor, time_strides: Sequence[int] = (2, 1)) -> torch.Tensor:
        """Output frames of utterances of ``lengths`` input frames under convolutions of these time strides."""
        for stride in time_strides:
            lengths = torch.div(lengths - 1, stride, rounding_mode="floor") + 1
        return lengths

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T, n_mels)`` -> log-probabilities ``(B, T', classes)`` and ``T'`` per utterance."""
        x = self.conv(feats.unsqueeze(1))  # (B, C, T', F')
        x = x.permute(0, 2, 1, 3).flatten(2)  # (B, T', C*F')
        out_lengths = self.output_lengths(lengths, self.time_strides)
        packed = nn.utils.rnn.pack_padded_sequence(x, out_lengths.cpu(), batch_first=True, enforce_sorted=False)
        y, _ = self.rnn(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
        y = y[..., : self.hparams.hidden_size] + y[..., self.hparams.hidden_size :]
        return self.out(y).log_softmax(-1), out_lengths

    def _ctc(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feats, lengths, targets, target_lengths = batch
        log_probs, out_lengths = self(feats, lengths)
        loss = nn.functional.ctc_loss(
            log_probs.transpose(0, 1), targets, out_lengths, target_lengths, blank=0, zero_infinity=True
        )
        return loss, log_probs, out_lengths

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._ctc(batch)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        loss, log_probs, out_lengths = self._ctc(batch)
        _, _, targets, target_lengths = batch
        refs = ["".join(ALPHABET[i] for i in t[:n].tolist()) for t, n in zip(targets, target_lengths.tolist())]
        self.val_wer(greedy_decode(log_probs, out_lengths), refs)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/wer", self.val_wer, prog_bar=True, sync_dist=True)
