"""``python -m mm_lightning`` -> :func:`mm_lightning.cli.main`."""

import sys

from mm_lightning.cli import main

if __name__ == "__main__":
    sys.exit(main())
