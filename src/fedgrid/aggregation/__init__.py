"""Pure aggregation math: strategies, server optimizers, robust aggregators, model partitions.

Everything here takes tensors and dataclasses and returns tensors and dataclasses; the
round engine and the fleets around it do the I/O.
"""

from fedgrid.aggregation.base import AggregationPreconditionError, Aggregator, Strategy
from fedgrid.aggregation.bcd import BlockCoordinate
from fedgrid.aggregation.blocks import Block, blocks_from_prefixes, default_blocks, matches_prefix
from fedgrid.aggregation.by_name import (
    AGGREGATORS,
    STRATEGIES,
    build_aggregator,
    build_strategy_from,
    strategy_options,
)
from fedgrid.aggregation.clipping import CenteredClip, NormClip
from fedgrid.aggregation.diloco import DiLoCo, StreamingDiLoCo
from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.fedopt import FedAdagrad, FedAdam, FedAvgM, FedOpt, FedYogi
from fedgrid.aggregation.fedprox import FedProx
from fedgrid.aggregation.mean import Mean, WeightedMean, weighted_mean
from fedgrid.aggregation.robust import Krum, Median, MultiKrum, TrimmedMean
from fedgrid.aggregation.scaffold import CONTROL_DELTA_PREFIX, CONTROL_PREFIX, Scaffold
from fedgrid.aggregation.server_opt import ServerAdagrad, ServerAdam, ServerOptimizer, ServerSGD, ServerYogi

__all__ = [
    "Aggregator",
    "AggregationPreconditionError",
    "Strategy",
    # strategies
    "FedAvg",
    "FedOpt",
    "FedAvgM",
    "FedAdam",
    "FedYogi",
    "FedAdagrad",
    "FedProx",
    "Scaffold",
    "DiLoCo",
    "StreamingDiLoCo",
    "BlockCoordinate",
    "STRATEGIES",
    "build_strategy_from",
    "strategy_options",
    # server optimizers
    "ServerOptimizer",
    "ServerSGD",
    "ServerAdam",
    "ServerYogi",
    "ServerAdagrad",
    # aggregators
    "WeightedMean",
    "Mean",
    "weighted_mean",
    "Median",
    "TrimmedMean",
    "Krum",
    "MultiKrum",
    "NormClip",
    "CenteredClip",
    "AGGREGATORS",
    "build_aggregator",
    # partitions and wire names
    "Block",
    "default_blocks",
    "blocks_from_prefixes",
    "matches_prefix",
    "CONTROL_PREFIX",
    "CONTROL_DELTA_PREFIX",
]
