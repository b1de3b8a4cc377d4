"""The demo rendered small, for the benchmarks' quick modes: small batches of a small generated set, and a warmup
short enough that a few steps reach the LR decay (which asks the trainer for the run's length)."""

SMALL_DEMO = [
    "--model.image_tower.init_args.image_size", "32",
    "--data.init_args.render_size", "32",
    "--data.init_args.train_renders", "1",
    "--data.init_args.num_val", "24",
    "--data.init_args.num_test", "24",
    "--data.init_args.batch_size", "8",
    "--model.optim.warmup_steps", "2",
]  # fmt: skip
