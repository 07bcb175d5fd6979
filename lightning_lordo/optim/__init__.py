"""Pure tensor math of LoRDO: the optimizer and the basis computations (no torch.distributed, no Lightning)."""

from lightning_lordo.optim.lordo import LoRDO

__all__ = ["LoRDO"]
