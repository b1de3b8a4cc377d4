"""The commands besides LightningCLI's (``python -m mm_lightning <command> --help``): ``audit``, ``shard``,
``evaluate``, ``export``, ``zeroshot``, each a module with ``main(argv)``."""
