"""The image preprocessing defaults, defined once: the towers declare what their weights expect (their
``data_config``) and the data side follows it; these are the values when nothing says otherwise."""

from __future__ import annotations

# ImageNet statistics of 0-1 images (torchvision's and timm's defaults)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# the image side when neither the data nor an image tower sets one (e.g. `audit` without a model)
DEFAULT_IMAGE_SIZE = 224
