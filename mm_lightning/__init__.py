"""mm_lightning: a PyTorch Lightning template for image-text (multimodal) training.

Run ``python -m mm_lightning fit --config configs/demo.yaml`` for the offline demo.
"""

from mm_lightning import process_exit

__version__ = "0.1.0"

# Two-process runs on gloo abort at interpreter exit unless the process group is destroyed first: see
# mm_lightning/process_exit.py.
process_exit.install()
