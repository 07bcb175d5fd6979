"""The Lightning Fabric glue: ``Fabric(strategy="lordo")`` on the same synchronizer as the Trainer's strategy."""

from lightning_lordo.fabric.strategy import LoRDOFabricStrategy

__all__ = ["LoRDOFabricStrategy"]
