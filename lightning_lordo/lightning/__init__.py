"""The Lightning glue: the strategy, the LightningOptimizer wrapper, the monitor callback, the optimizer conversion
and checkpoints."""
