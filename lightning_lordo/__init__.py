"""lightning-lordo: communication-efficient distributed training for PyTorch Lightning (LoRDO).

``import lightning_lordo`` registers the strategy names with Lightning, then ``Trainer(strategy="lordo")``.
"""

from lightning_lordo.optim import LoRDO

__version__ = "0.1.0"

__all__ = ["LoRDO", "__version__"]
