"""Pure aggregation math: strategies, aggregators."""

from fedgrid.aggregation.base import Aggregator, Strategy
from fedgrid.aggregation.fedavg import FedAvg, WeightedMean, weighted_mean

__all__ = ["Aggregator", "Strategy", "FedAvg", "WeightedMean", "weighted_mean"]
