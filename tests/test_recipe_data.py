"""The recipes' loaders read the real on-disk formats; missing data says where to put it."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from apprun import SHARED_DATA

from recipes.common import WarmupMultiStep, loader_workers
from recipes.images import (
    CIFAR10_ARCHIVE,
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10DataModule,
    ImageNetDataModule,
)
from recipes.language import PTBDataModule
from recipes.speech import ALPHABET, SpeechDataModule, encode_text, greedy_decode, mel_filterbank
from recipes.vision import ImageClassifier

needs_ptb = pytest.mark.skipif(not (SHARED_DATA / "ptb").is_dir(), reason=f"no PTB files in {SHARED_DATA}")
needs_librispeech = pytest.mark.skipif(
    not (SHARED_DATA / "librispeech").is_dir(), reason=f"no LibriSpeech files in {SHARED_DATA}"
)
needs_yesno = pytest.mark.skipif(not (SHARED_DATA / "yesno").is_dir(), reason=f"no yesno corpus in {SHARED_DATA}")


@needs_ptb
def test_ptb_reads_mikolovs_files() -> None:
    dm = PTBDataModule(root=str(SHARED_DATA / "ptb"), bptt=35)
    dm.setup()
    assert dm.vocab is not None and dm.vocab_size == 10_000  # 9,999 words + <eos>
    assert len(dm.train_set) == (929_589 - 1) // 35  # every token, <eos> included
    first_line = (SHARED_DATA / "ptb" / "ptb.train.txt").read_text().splitlines()[0].split()
    words = {i: w for w, i in dm.vocab.items()}
    x, y = dm.train_set[0]
    assert [words[int(i)] for i in x[: len(first_line)]] == first_line
    assert words[int(x[len(first_line)])] == "<eos>"
    assert torch.equal(x[1:], y[:-1])  # targets are the next tokens
    assert torch.equal(dm.train_set[1][0][0:1], y[-1:])  # windows are consecutive
    assert not hasattr(dm, "test_set")  # read only for a test stage
    dm.setup("test")
    assert len(dm.test_set) == (82_430 - 1) // 35  # Mikolov's test text, 82,430 tokens with <eos>
    test_line = (SHARED_DATA / "ptb" / "ptb.test.txt").read_text().splitlines()[0].split()
    assert [words[int(i)] for i in dm.test_set[0][0][: len(test_line)]] == test_line


@needs_librispeech
def test_librispeech_reads_flac_and_transcripts() -> None:
    dm = SpeechDataModule(
        root=str(SHARED_DATA / "librispeech"), train_subsets=("test-clean",), val_subsets=("test-clean",), num_workers=0
    )
    dm.setup()
    items = dm.train_set.items
    assert len(items) == 4 and all(path.suffix == ".flac" and path.is_file() for path, _ in items)
    trans = (SHARED_DATA / "librispeech/LibriSpeech/test-clean/1089/134686/1089-134686.trans.txt").read_text()
    utt, text = trans.splitlines()[0].split(" ", 1)
    assert items[0] == (items[0][0].with_name(f"{utt}.flac"), text)
    import soundfile

    seconds = soundfile.info(str(items[0][0])).duration
    feats, target = dm.train_set[0]
    assert feats.shape[1] == 80 and abs(feats.shape[0] - seconds * 100) <= 2  # 10 ms hop
    assert torch.isfinite(feats).all()
    assert "".join(ALPHABET[i] for i in target) == text


@needs_yesno
def test_yesno_transcripts_come_from_file_names() -> None:
    dm = SpeechDataModule(root=str(SHARED_DATA / "yesno"), corpus="yesno", n_mels=40, batch_size=4, num_workers=0)
    dm.setup()
    assert len(dm.train_set) == 45 and len(dm.val_set) == 15
    path, text = dm.train_set.items[0]
    assert path.name == "0_0_0_0_1_1_1_1.wav" and text == "NO NO NO NO YES YES YES YES"
    feats, lengths, targets, target_lengths = next(iter(dm.val_dataloader()))
    assert feats.shape[0] == 4 and feats.shape[2] == 40 and lengths.max() == feats.shape[1]
    assert feats.shape[1] > 500  # ~6 s of 8 kHz audio at a 10 ms hop
    texts = [text for _, text in dm.val_set.items[:4]]
    assert target_lengths.tolist() == [len(t) for t in texts]
    assert "".join(ALPHABET[i] for i in targets[0, : target_lengths[0]]) == texts[0]


def _write_cifar(root: Path, per_batch: int) -> tuple[np.ndarray, list[int]]:
    """CIFAR-10's python format: pickled dicts with 'data' (N x 3072 uint8, CHW rows) and 'labels'."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return data, labels  # the test batch


def test_cifar10_reads_python_batches(tmp_path: Path) -> None:
    test_data, test_labels = _write_cifar(tmp_path, per_batch=6)
    dm = CIFAR10DataModule(root=str(tmp_path), download=False, batch_size=4, num_workers=0)
    dm.prepare_data()
    dm.setup()
    assert len(dm.train_set) == 30 and len(dm.val_set) == 6
    image, label = dm.val_set[2]  # validation: no augmentation, just normalisation
    expected = torch.tensor(test_data[2].reshape(3, 32, 32), dtype=torch.float32) / 255
    expected = (expected - torch.tensor(CIFAR10_MEAN)[:, None, None]) / torch.tensor(CIFAR10_STD)[:, None, None]
    assert label == test_labels[2] and torch.allclose(image, expected, atol=1e-5)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and y.shape == (4,)


def _write_cifar_jpegs(folder: Path, per_class: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    for name in CIFAR10_CLASSES:
        (folder / "train" / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((32, 32, 3), CIFAR10_CLASSES.index(name) * 20, dtype=np.uint8)
            pixels[0, 0] = rng.integers(0, 256, 3)
            Image.fromarray(pixels).save(folder / "train" / name / f"{i:04d}.jpg", quality=100)


@pytest.mark.parametrize("packed", [False, True])
def test_cifar10_reads_training_jpegs_with_a_seeded_held_out_split(tmp_path: Path, packed: bool) -> None:
    """The JPEG tree (or its tar.gz): labels by folder in CIFAR-10's class order, ``val_size``
    images held out by a seeded permutation, identical in every process, never trained on."""
    _write_cifar_jpegs(tmp_path / "tree", per_class=3)
    root = tmp_path / "tree"
    if packed:
        root = tmp_path / "packed"
        root.mkdir()
        with tarfile.open(root / CIFAR10_ARCHIVE, "w:gz") as tar:
            tar.add(tmp_path / "tree" / "train", arcname="train")

    def split(seed: int) -> CIFAR10DataModule:
        dm = CIFAR10DataModule(root=str(root), download=False, val_size=8, split_seed=seed, num_workers=0, batch_size=4)
        dm.prepare_data()
        dm.setup()
        return dm

    dm = split(0)
    assert dm.source() == ("archive" if packed else "folder")
    assert len(dm.train_set) == 22 and len(dm.val_set) == 8
    image, label = dm.val_set[0]  # each class's images are one grey level: label and pixels agree
    grey = (label * 20 / 255 - torch.tensor(CIFAR10_MEAN)) / torch.tensor(CIFAR10_STD)
    assert torch.allclose(image[:, 16, 16], grey, atol=0.05)

    def contents(ds) -> set[bytes]:
        return {image.numpy().tobytes() for image in ds.images}

    assert len(contents(dm.train_set) | contents(dm.val_set)) == 30  # all distinct: a random corner pixel each
    assert not contents(dm.train_set) & contents(dm.val_set)  # held out means never trained on
    assert torch.equal(split(0).val_set.images, dm.val_set.images)  # same seed, same split: every rank agrees
    assert not torch.equal(split(1).val_set.images, dm.val_set.images)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and y.shape == (4,)
    subset = CIFAR10DataModule(root=str(root), download=False, val_size=8, train_size=5, num_workers=0)
    subset.setup()
    assert len(subset.train_set) == 5 and torch.equal(subset.val_set.images, dm.val_set.images)


def test_cifar10_refuses_a_held_out_split_that_leaves_nothing_to_train_on(tmp_path: Path) -> None:
    _write_cifar_jpegs(tmp_path, per_class=1)
    with pytest.raises(ValueError, match="data.val_size=10 leaves no training images of the 10"):
        CIFAR10DataModule(root=str(tmp_path), download=False, val_size=10).setup()
    with pytest.raises(ValueError, match="data.train_size"):
        CIFAR10DataModule(root=str(tmp_path), train_size=0)


@pytest.mark.skipif(not (SHARED_DATA / "cifar10" / CIFAR10_ARCHIVE).is_file(), reason="no shared CIFAR-10 archive")
def test_cifar10_reads_the_shared_training_archive_offline() -> None:
    dm = CIFAR10DataModule(root=str(SHARED_DATA / "cifar10"), download=False, num_workers=0, batch_size=8)
    dm.check_data()
    dm.setup()
    assert dm.source() == "archive" and len(dm.train_set) == 45_000 and len(dm.val_set) == 5_000
    counts = torch.bincount(dm.val_set.labels, minlength=10)
    assert counts.sum() == 5000 and counts.min() > 400  # a random 10 %: every class about 500
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.mean().abs() < 1.5 and y.max() < 10


def test_imagenet_reads_an_image_folder(tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 2)):
        for wnid in ("n01440764", "n01443537"):
            (tmp_path / split / wnid).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / wnid / f"{wnid}_{i}.png")
    dm = ImageNetDataModule(root=str(tmp_path), image_size=16, batch_size=2, num_workers=0)
    dm.setup()
    assert dm.train_set.classes == ["n01440764", "n01443537"] and len(dm.train_set) == 6 and len(dm.val_set) == 4
    image, label = dm.val_set[3]
    assert image.shape == (3, 16, 16) and label == 1
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 16, 16)


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (lambda root: CIFAR10DataModule(root=root, download=False), "cifar-10-batches-py"),
        (lambda root: ImageNetDataModule(root=root), "ImageFolder layout"),
        (lambda root: PTBDataModule(root=root), "ptb.train.txt"),
        (lambda root: SpeechDataModule(root=root), "openslr.org/12"),
        (lambda root: SpeechDataModule(root=root, corpus="yesno"), "waves_yesno"),
    ],
)
def test_missing_dataset_says_where_and_how(module, expected: str, tmp_path: Path) -> None:
    dm = module(str(tmp_path / "nothing"))
    for step in (dm.check_data, dm.setup):  # check_data: what train.py asks before launching
        with pytest.raises(FileNotFoundError) as err:
            step()
        message = str(err.value)
        assert expected in message and str(tmp_path / "nothing") in message and "data.synthetic=true" in message
    assert type(dm)(synthetic=True).check_data() is None  # made-up data needs no files


def test_synthetic_data_has_the_real_shapes() -> None:
    cifar = CIFAR10DataModule(synthetic=True, synthetic_size=8, batch_size=4)
    cifar.setup()
    x, y = next(iter(cifar.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and y.max() < 10
    ptb = PTBDataModule(synthetic=True, synthetic_size=4, batch_size=2, bptt=35)
    ptb.setup()
    x, y = next(iter(ptb.train_dataloader()))
    assert x.shape == y.shape == (2, 35) and x.max() < 10_000
    again = PTBDataModule(synthetic=True, synthetic_size=4, batch_size=2, bptt=35)
    again.setup()
    assert torch.equal(ptb.train_set[1][0], again.train_set[1][0])  # same made-up data on every rank


def test_lr_schedule_warms_up_linearly_then_steps() -> None:
    schedule = WarmupMultiStep(steps_per_epoch=10, warmup_epochs=5, milestones=[82, 123], gamma=0.1, start=0.1)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(25) == pytest.approx(0.1 + 0.9 * 2.5 / 5)
    assert schedule(50) == 1.0 and schedule(819) == 1.0
    assert schedule(820) == pytest.approx(0.1) and schedule(1230) == pytest.approx(0.01)


@pytest.mark.parametrize(("max_steps", "factor"), [(12, 1.0), (20, 0.1)])
def test_lr_milestones_count_epochs_in_a_run_bounded_by_steps(max_steps: int, factor: float) -> None:
    """With ``max_epochs=-1`` Lightning does not load the training data to configure optimizers;
    the milestones must still be read in epochs of 8 steps (once taken as 1 step per epoch, a
    milestone at epoch 2 fell at step 2)."""
    import lightning as L

    from recipes.language import TransformerLanguageModel

    data = PTBDataModule(synthetic=True, synthetic_size=64, batch_size=8, bptt=8, vocab_size=50)  # 8 steps per epoch
    model = TransformerLanguageModel(
        vocab_size=50, d_model=8, num_heads=2, num_layers=1, ff_size=16, max_length=8, lr=1e-3, lr_milestones=[2.0]
    )
    trainer = L.Trainer(
        max_epochs=-1, max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, data)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * factor)  # epoch 1.5, then 2.5
    saved = trainer.lr_scheduler_configs[0].scheduler.state_dict()  # as a checkpoint holds it: plain data
    torch.save(saved, io.BytesIO())
    assert saved["lr_lambdas"][0]["steps_per_epoch"] == 8


def test_ctc_text_helpers() -> None:
    ids = encode_text("yes no")
    assert "".join(ALPHABET[i] for i in ids) == "YES NO"
    # best path "YY_E_S  NN_O" -> merge repeats, drop blanks
    path = [ALPHABET.index(c) for c in "YY_ES__ NNO"]
    log_probs = torch.nn.functional.one_hot(torch.tensor([path]), len(ALPHABET)).float()
    assert greedy_decode(log_probs, torch.tensor([len(path)])) == ["YES NO"]
    with pytest.raises(ValueError, match="outside"):
        encode_text("naïve")
    bank = mel_filterbank(n_fft=512, n_mels=40, sample_rate=16_000)
    assert bank.shape == (257, 40) and (bank.sum(0) > 0).all() and bank.max() <= 1.0


def test_digits_synthetic_is_identical_on_every_rank() -> None:
    from recipes.quickstart import DigitsDataModule

    a, b = DigitsDataModule(synthetic=True), DigitsDataModule(synthetic=True)
    a.setup()
    b.setup()
    assert a.train_set.tensors[0].shape == (1438, 64)
    assert all(torch.equal(s, t) for s, t in zip(a.train_set.tensors, b.train_set.tensors))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ImageClassifier(arch="resnet21"), "`model.arch` must be one of"),
        (lambda: SpeechDataModule(corpus="timit"), "`data.corpus` must be one of \\['librispeech', 'yesno'\\]"),
        (lambda: PTBDataModule(batch_size=0), "`data.batch_size` must be an integer >= 1, got 0"),
        (lambda: WarmupMultiStep(10, gamma=1.5), "`gamma` must be in \\(0, 1\\], got 1.5"),
        (lambda: ImageClassifier(lr_gamma=0.0), "`model.lr_gamma` must be in \\(0, 1\\], got 0.0"),
        (lambda: ImageClassifier(lr_milestones=[30, -1]), "`model.lr_milestones\\[1\\]` must be in \\[0, inf\\]"),
    ],
)
def test_bad_task_options_name_the_option_and_the_choices(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("has_data_filter", [True, False])
def test_archives_extract_only_plain_files_inside_the_destination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, has_data_filter: bool
) -> None:
    """Where tarfile has no ``filter="data"`` (Python before 3.10.12), members are checked by hand."""
    import io
    import tarfile

    from recipes.language import safe_extract

    if not has_data_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)

    def archive(name: str) -> Path:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.tar"
        with tarfile.open(path, "w") as tar:
            info = tarfile.TarInfo(name)
            info.size = 5
            tar.addfile(info, io.BytesIO(b"words"))
        return path

    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(archive("simple-examples/data/ptb.train.txt")) as tar:
        safe_extract(tar, out)
    assert (out / "simple-examples" / "data" / "ptb.train.txt").read_text() == "words"
    with tarfile.open(archive("../escaped.txt")) as tar, pytest.raises(Exception, match="escaped.txt"):
        safe_extract(tar, out)
    assert not (tmp_path / "escaped.txt").exists()


def test_a_failed_download_says_what_to_do_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error

    import torchvision.datasets.utils

    from recipes.language import PTBDataModule

    def no_network(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.datasets.utils, "download_url", no_network)
    with pytest.raises(RuntimeError, match="downloading Penn Treebank from .* failed") as error:
        PTBDataModule(root=str(tmp_path), download=True).prepare_data()
    assert f"data.root={str(tmp_path)!r} and set data.download=false" in str(error.value)

    # train.py downloads in the launching process, so the failure is one UsageError line (exit 2)
    # before any other rank starts; ranks a launcher started leave the download to Lightning
    from recipes.app import UsageError, prepare_in_launcher

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    with pytest.raises(UsageError, match="downloading Penn Treebank from .* failed"):
        prepare_in_launcher(PTBDataModule(root=str(tmp_path), download=True))
    monkeypatch.setenv("LOCAL_RANK", "1")
    prepare_in_launcher(PTBDataModule(root=str(tmp_path), download=True))  # not its job: no error here


@pytest.mark.parametrize(
    ("cores", "processes", "requested", "expected"),
    [(2, 2, 4, 0), (2, 1, 4, 1), (96, 8, 4, 4), (96, 8, 16, 11), (16, 1, 0, 0)],
)
def test_loader_workers_fit_the_cores_each_training_process_has_to_spare(
    monkeypatch: pytest.MonkeyPatch, cores: int, processes: int, requested: int, expected: int
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert loader_workers(requested, processes) == expected
