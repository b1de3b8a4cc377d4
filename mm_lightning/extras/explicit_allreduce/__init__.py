"""DDP with an explicit gradient all-reduce (``--trainer.strategy ddp_explicit``): the strategy (:mod:`.strategy`)
and the reducers it runs once per optimizer step (:mod:`.reducers`)."""
