"""mm_lightning: a PyTorch Lightning template for image-text (multimodal) training.

Run ``python -m mm_lightning fit --config configs/demo.yaml`` for the offline demo.
"""

__version__ = "0.1.0"
