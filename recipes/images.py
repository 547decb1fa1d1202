"""Image datamodules: CIFAR-10 (torchvision's batches, or the training JPEGs) and ImageNet (ImageFolder layout).

Standard augmentation: CIFAR-10 trains on random 32x32 crops of the 4-pixel zero-padded image
with horizontal flips (He et al. 2016); ImageNet on random-resized crops with flips, evaluated on
the 224 centre crop of the image resized to 256 (torchvision's reference recipe). Both normalise
by the dataset's channel means and standard deviations.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import datasets, transforms

from lightning_gc.common.validation import check_int
from recipes.common import RecipeDataModule, SyntheticDataset, dataset_missing, fetching

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class _CIFAR10Files(datasets.CIFAR10):
    """torchvision's CIFAR10 that trusts batch files already on disk.

    torchvision checks the MD5 of every batch file before reading it, which rejects anything but
    the official files. Here a missing file is still an error and a download still verifies the
    archive's MD5 (``tgz_md5``); only the per-file checks of files on disk are dropped.
    """

    train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
    test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
    meta = {**datasets.CIFAR10.meta, "md5": None}


class ImageDataModule(RecipeDataModule):
    """Base of the image datamodules: made-up images of the real shapes, or the subclass's files.

    Args:
        root: the dataset's directory (``data.root``).
        batch_size: per-process batch size (global batch = batch_size x processes).
        num_workers: loader worker processes (synthetic data is made in the main process).
        synthetic: use made-up images and labels of the real shapes instead of files.
        synthetic_size: number of made-up training images (validation: a quarter, at least 1).
    """

    num_classes: int
    image_size: int
    download: bool = False

    def __init__(
        self,
        root: str = "data",
        batch_size: int = 128,
        num_workers: int = 4,
        synthetic: bool = False,
        synthetic_size: int = 512,
    ) -> None:
        super().__init__(root, batch_size, num_workers, synthetic, synthetic_size)

    def _synthetic(self, size: int, seed: int) -> Dataset:
        shape, classes = (3, self.image_size, self.image_size), self.num_classes

        def make(g: torch.Generator) -> tuple[torch.Tensor, int]:
            return torch.randn(shape, generator=g), int(torch.randint(classes, (), generator=g))

        return SyntheticDataset(size, make, seed)

    def setup(self, stage: str | None = None) -> None:
        if self.synthetic:
            self.train_set = self._synthetic(self.synthetic_size, seed=0)
            self.val_set = self._synthetic(max(1, self.synthetic_size // 4), seed=1)
        else:
            self.require_files()
            self.train_set, self.val_set = self.real_datasets()

    def check_data(self) -> None:
        """Raise the missing-dataset error now (before any process starts) unless the data is
        synthetic, will be downloaded, or is there."""
        if not (self.synthetic or self.download):
            self.require_files()

    def require_files(self) -> None:
        """Raise the missing-dataset error (where to put the files, how to get them) if absent."""
        raise NotImplementedError

    def real_datasets(self) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def loader_options(self) -> dict[str, Any]:
        return {"pin_memory": torch.cuda.is_available()}


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
"""CIFAR-10's labels 0..9, as in its ``batches.meta``."""
CIFAR10_ARCHIVE = "cifar10-train-jpeg.tar.gz"
"""The training split as JPEGs in ImageFolder layout (``train/<class>/*.jpg``), one tar.gz file."""


class CIFARImages(Dataset):
    """Images held in memory as one uint8 tensor (N x 3 x 32 x 32) with their labels.

    ``transform`` maps a float image in [0, 1] to the model's input (augmentation, normalisation).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor]):
        if images.dtype != torch.uint8 or images.dim() != 4 or len(images) != len(labels):
            raise ValueError(
                f"expected N x C x H x W uint8 images and N labels, got {tuple(images.shape)} and {len(labels)}"
            )
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index].float().div_(255)), int(self.labels[index])


def decode_cifar_jpegs(files: Iterable[tuple[str, bytes]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(images N x 3 x 32 x 32 uint8, labels) of ``(path, JPEG bytes)`` pairs named ``.../<class>/<file>``,
    in path order (so every process and every source gives the same order); labels follow
    CIFAR-10's class order (airplane = 0 ... truck = 9)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    index = {name: i for i, name in enumerate(CIFAR10_CLASSES)}
    ordered = sorted(files)
    unknown = sorted({PurePosixPath(path).parent.name for path, _ in ordered} - index.keys())
    if unknown:
        raise ValueError(f"CIFAR-10 JPEGs must sit in folders named after the classes {sorted(index)}, found {unknown}")
    labels = torch.tensor([index[PurePosixPath(path).parent.name] for path, _ in ordered])
    raw = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _, data in ordered]
    images = (
        torch.stack(decode_jpeg(raw, mode=ImageReadMode.RGB)) if raw else torch.empty(0, 3, 32, 32, dtype=torch.uint8)
    )
    return images, labels


def _archive_files(archive: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(archive) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile() and m.name.lower().endswith(".jpg")]


def _folder_files(folder: Path) -> list[tuple[str, bytes]]:
    return [(path.relative_to(folder).as_posix(), path.read_bytes()) for path in folder.glob("*/*.jpg")]


class CIFAR10DataModule(ImageDataModule):
    """CIFAR-10 from the first of these found under ``root``:

    1. torchvision's python batches, ``cifar-10-batches-py/`` (validation: the official test split);
    2. the training JPEGs in ImageFolder layout, ``train/<class>/*.jpg``;
    3. the archive of that layout, ``cifar10-train-jpeg.tar.gz`` (read in memory, nothing extracted);

    else torchvision downloads (1) when ``download=true``. Sources 2 and 3 hold only the training
    split: ``val_size`` of its images, picked by a permutation seeded with ``split_seed`` (the same
    in every process), are held out for validation and never trained on.

    Args:
        download: fetch the python batches when no source is under ``root``.
        val_size: images held out of the training split when the source has no test split.
        split_seed: seed of the held-out split and of the training subset.
        train_size: train on only this many images (the first of the seeded permutation that are
            not held out); ``None``: all of them.
    """

    num_classes = 10
    image_size = 32

    def __init__(
        self,
        download: bool = True,
        val_size: int = 5000,
        split_seed: int = 0,
        train_size: int | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.download = bool(download)
        self.val_size = check_int("data.val_size", val_size, 1)
        self.split_seed = check_int("data.split_seed", split_seed, 0)
        self.train_size = None if train_size is None else check_int("data.train_size", train_size, 1)

    def source(self) -> str | None:
        """``"batches"``, ``"folder"`` or ``"archive"``: what :meth:`setup` will read; ``None`` if nothing is there."""
        batches = self.root / _CIFAR10Files.base_folder
        names = [name for name, _ in _CIFAR10Files.train_list + _CIFAR10Files.test_list]
        if all((batches / name).is_file() for name in names):
            return "batches"
        if (self.root / "train").is_dir():
            return "folder"
        if (self.root / CIFAR10_ARCHIVE).is_file():
            return "archive"
        return None

    def prepare_data(self) -> None:
        if self.download and not self.synthetic and self.source() is None:
            with fetching("CIFAR-10", _CIFAR10Files.url, self.root):
                _CIFAR10Files(str(self.root), train=True, download=True)

    def require_files(self) -> None:
        if self.source() is not None:
            return
        raise dataset_missing(
            "CIFAR-10",
            self.root,
            f"cifar-10-batches-py/{{data_batch_1..5,test_batch}}, train/<class>/*.jpg or {CIFAR10_ARCHIVE}",
            "Set data.download=true to fetch it (170 MB, https://www.cs.toronto.edu/~kriz/cifar.html).",
        )

    def real_datasets(self) -> tuple[Dataset, Dataset]:
        normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
        train_tf = transforms.Compose(
            [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), normalize]
        )
        source = self.source()
        if source == "batches":
            train = _CIFAR10Files(str(self.root), train=True)
            test = _CIFAR10Files(str(self.root), train=False)
            train_images, train_labels = _chw(train.data), torch.tensor(train.targets)
            val_images, val_labels = _chw(test.data), torch.tensor(test.targets)
            order = torch.randperm(len(train_images), generator=torch.Generator().manual_seed(self.split_seed))
        else:
            files = (
                _folder_files(self.root / "train")
                if source == "folder"
                else _archive_files(self.root / CIFAR10_ARCHIVE)
            )
            images, labels = decode_cifar_jpegs(files)
            if self.val_size >= len(images):
                raise ValueError(
                    f"data.val_size={self.val_size} leaves no training images of the {len(images)} in {self.root}"
                )
            permutation = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.split_seed))
            held_out, order = permutation[: self.val_size], permutation[self.val_size :]
            val_images, val_labels = images[held_out], labels[held_out]
            train_images, train_labels = images, labels
        if self.train_size is not None:
            order = order[: self.train_size]
        elif source == "batches":
            order = torch.arange(len(train_images))  # all of them, in the files' order
        return (
            CIFARImages(train_images[order], train_labels[order], train_tf),
            CIFARImages(val_images, val_labels, normalize),
        )


def _chw(images: np.ndarray) -> torch.Tensor:
    """N x H x W x C uint8 (torchvision's ``CIFAR10.data``) as N x C x H x W."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()


class ImageNetDataModule(ImageDataModule):
    """ImageNet (ILSVRC-2012) in torchvision's ``ImageFolder`` layout:
    ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG``.

    Args:
        image_size: training crop size (224); validation resizes to ``image_size * 8 / 7`` and
            centre-crops ``image_size``.
        num_classes: classes of the synthetic data (the real set has as many as folders).
    """

    def __init__(self, image_size: int = 224, num_classes: int = 1000, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.image_size = check_int("data.image_size", image_size, 8)
        self.num_classes = check_int("data.num_classes", num_classes, 2)

    def require_files(self) -> None:
        if not ((self.root / "train").is_dir() and (self.root / "val").is_dir()):
            raise dataset_missing(
                "ImageNet",
                self.root,
                "train/<class>/*.JPEG and val/<class>/*.JPEG (ImageFolder layout)",
                "ImageNet cannot be downloaded automatically: register at https://image-net.org, "
                "download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar, and sort the validation "
                "images into one folder per class.",
            )

    def real_datasets(self) -> tuple[Dataset, Dataset]:
        train_dir, val_dir = self.root / "train", self.root / "val"
        normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        size = self.image_size
        train_tf = transforms.Compose(
            [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
        )
        val_tf = transforms.Compose(
            [transforms.Resize(size * 8 // 7), transforms.CenterCrop(size), transforms.ToTensor(), normalize]
        )
        train = datasets.ImageFolder(str(train_dir), transform=train_tf)
        val = datasets.ImageFolder(str(val_dir), transform=val_tf)
        if train.classes != val.classes:
            raise ValueError(f"ImageNet train/ and val/ under {self.root} have different class folders")
        return train, val
