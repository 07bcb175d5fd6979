"""lightning-lordo: communication-efficient distributed training for PyTorch Lightning (LoRDO).

``import lightning_lordo`` registers the strategy names with Lightning's Trainer and with Lightning Fabric
(``"lordo"``, ``"lordo_lean"``, ``"lordo_local"``, ``"diloco"``, ``"lordo_compressed"`` and ``"lowrank_ddp"``,
each also with ``_spawn`` and ``_fork`` launchers; :data:`lightning_lordo.strategy_knobs.PRESETS`), then
``Trainer(strategy="lordo")`` or ``Fabric(strategy="lordo")``. With knobs: ``LoRDOStrategy(preset="lordo_compressed",
sync_every=8, optimizer={"rank": 8}, experimental=Experimental(basis_every=2))``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_lordo.comm.communicator import CollectiveTimeout
from lightning_lordo.config import SyncConfig
from lightning_lordo.fabric import LoRDOFabricStrategy
from lightning_lordo.lightning import cli_names  # noqa: F401 - the names as classes, for LightningCLI
from lightning_lordo.lightning.callbacks import CommunicationMonitor
from lightning_lordo.lightning.export import ConvertLoRDOCheckpoint
from lightning_lordo.lightning.strategy import LoRDOStrategy
from lightning_lordo.optim import LoRDO
from lightning_lordo.strategy_knobs import Experimental
from lightning_lordo.sync.faults import NonFiniteTraining

__version__ = "0.1.0"

# idempotent: names already present are skipped (children and test re-imports import again)
LoRDOStrategy.register_strategies(StrategyRegistry)
LoRDOFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = ["CollectiveTimeout", "CommunicationMonitor", "ConvertLoRDOCheckpoint", "Experimental", "LoRDO",
           "LoRDOFabricStrategy", "LoRDOStrategy", "NonFiniteTraining", "SyncConfig", "__version__"]
