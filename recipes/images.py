"""Image datamodules: CIFAR-10 (torchvision's loader) and ImageNet (ImageFolder layout).

Standard augmentation: CIFAR-10 trains on random 32x32 crops of the 4-pixel zero-padded image
with horizontal flips (He et al. 2016); ImageNet on random-resized crops with flips, evaluated on
the 224 centre crop of the image resized to 256 (torchvision's reference recipe). Both normalise
by the dataset's channel means and standard deviations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision import datasets, transforms

from lightning_gc.validation import check_int
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


class CIFAR10DataModule(ImageDataModule):
    """CIFAR-10 through ``torchvision.datasets.CIFAR10`` (the python pickle batches in
    ``<root>/cifar-10-batches-py``); downloaded there when ``download=true``."""

    num_classes = 10
    image_size = 32

    def __init__(self, download: bool = True, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.download = bool(download)

    def prepare_data(self) -> None:
        if self.download and not self.synthetic:
            with fetching("CIFAR-10", _CIFAR10Files.url, self.root):
                _CIFAR10Files(str(self.root), train=True, download=True)

    def require_files(self) -> None:
        folder = self.root / _CIFAR10Files.base_folder
        names = [name for name, _ in _CIFAR10Files.train_list + _CIFAR10Files.test_list]
        if all((folder / name).is_file() for name in names):
            return
        raise dataset_missing(
            "CIFAR-10",
            self.root,
            "cifar-10-batches-py/{data_batch_1..5,test_batch}",
            "Set data.download=true to fetch it (170 MB, https://www.cs.toronto.edu/~kriz/cifar.html).",
        )

    def real_datasets(self) -> tuple[Dataset, Dataset]:
        normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
        train_tf = transforms.Compose(
            [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
        )
        val_tf = transforms.Compose([transforms.ToTensor(), normalize])
        train = _CIFAR10Files(str(self.root), train=True, transform=train_tf)
        val = _CIFAR10Files(str(self.root), train=False, transform=val_tf)
        return train, val


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
