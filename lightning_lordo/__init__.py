"""lightning-lordo: communication-efficient distributed training for PyTorch Lightning (LoRDO).

``import lightning_lordo`` registers the strategy names with Lightning (``"lordo"``, ``"lordo_local"``,
``"diloco"``, each also with ``_spawn`` and ``_fork`` launchers), then ``Trainer(strategy="lordo")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_lordo.comm.communicator import CollectiveTimeout
from lightning_lordo.config import SyncConfig
from lightning_lordo.lightning.callbacks import CommunicationMonitor
from lightning_lordo.lightning.strategy import LoRDOStrategy
from lightning_lordo.optim import LoRDO
from lightning_lordo.sync.faults import NonFiniteTraining

__version__ = "0.1.0"

LoRDOStrategy.register_strategies(StrategyRegistry)  # idempotent: names already present are skipped

__all__ = ["CollectiveTimeout", "CommunicationMonitor", "LoRDO", "LoRDOStrategy", "NonFiniteTraining", "SyncConfig",
           "__version__"]
