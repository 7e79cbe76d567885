"""Device-layout strategies, registered by name for `config.strategy.name`."""

from strategies.base import Strategy
from strategies.capabilities import Ensemble, member_rng
from strategies.mesh import BATCH_AXIS, GlobalMeshBatch, OneProcess
from strategies.pmap_data_parallel import PmapDataParallel
from strategies.pmap_ensemble import PmapEnsemble
from strategies.registry import available, check_processes, create_strategy, register
from strategies.sharded_data_parallel import ShardedDataParallel
from strategies.sharded_ensemble import ShardedEnsemble
from strategies.single_device import SingleDevice

__all__ = [
    "BATCH_AXIS",
    "Ensemble",
    "GlobalMeshBatch",
    "OneProcess",
    "PmapDataParallel",
    "PmapEnsemble",
    "ShardedDataParallel",
    "ShardedEnsemble",
    "SingleDevice",
    "Strategy",
    "available",
    "check_processes",
    "create_strategy",
    "member_rng",
    "register",
]
