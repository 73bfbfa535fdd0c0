"""The client halves of the training algorithms: one ``ClientAlgorithm`` class each, by ``algorithm`` key.

The server half of each lives in ``fedgrid.aggregation``; it tells clients what to do
through the task config only, so a client reached over gRPC (which sees the config, not
the server-side ``FitIns.expected``) sends exactly the tensors its task declares:

- ``fedavg`` (no ``algorithm`` key: FedAvg and the FedOpt family): train the whole model
  for ``local_epochs``, send the model.
- ``fedprox``: as ``fedavg`` with ``proximal_mu / 2 * ||w - w_global||^2`` added to the loss.
- ``scaffold``: the download holds ``scaffold.c.<name>`` tensors (the server control
  variate) besides the model; each step's gradient is corrected by ``c - c_i``; the upload
  is the model plus ``scaffold.c_delta.<name>`` for every control tensor.
- ``diloco``: ``inner_steps`` steps of a persistent inner optimizer (AdamW by default);
  with ``sync_delay_steps`` (tau) or ``merge_alpha`` above 0, on a replica kept across
  rounds into which the whole download is merged.
- ``streaming-diloco``: as ``diloco`` on a local replica kept across rounds; only the
  ``merge_fragment_prefixes`` tensors are merged from the download, only the
  ``fragment_prefixes`` tensors are sent.

- ``bcd``: only the ``block_prefixes`` tensors train (the rest frozen, their modules in
  eval mode so their buffers stay as downloaded) and only they are sent.

The two DiLoCo halves overlap their sync with training when the task asks (``fedgrid.aggregation.diloco.Overlap``):
``lookahead`` tells the trainer to keep training tau steps after the upload is built, and
``resume`` hands the replica those steps trained to the algorithm, whose next ``start``
merges the download into it with alpha.

Each is a ``ClientAlgorithm``: hooks that every trainer calls in the same order, so the
trainer itself never asks which algorithm runs (``TorchClient.fit``, a multi-process
subclass of it, and the batched simulation engine ``fedgrid.simulation.batched``). A fit
of task ``ctx`` (a ``FitContext``) runs::

    loop(ctx=)                              -> Loop(epochs, steps)
    time_budget(ctx=)                       -> seconds of steps instead of Loop.steps (0: none)
    lookahead(ctx=)                         -> steps to train after the upload (0: none)
    start(download=, ctx=)                  -> the state to load and train from
    trained(names=, ctx=)                   -> the state names that train
    optimizer(trainer=, params=, ctx=)      -> the optimizer of the round
    begin(params=, ctx=)                    -> round-local state (anchors, corrections)
    after_backward(params=)                 after each backward pass, before the step
    upload(state=, trained=, ctx=)          -> the tensors sent

then, when ``lookahead`` is above 0, the trainer trains that many more steps (in the
background while the network works) and calls ``resume(state=)`` with the state they
reached (``None`` if they failed) before the next ``start``. ``state_dict`` /
``load_state_dict`` carry what it keeps across rounds. The batched
engine does not call ``after_backward``: it applies the hook's tensorized form, which an
algorithm states as data (``proximal_mu``, ``correction``, ``record``). An algorithm that
defines ``after_backward`` without restating ``not_batchable`` is trained one client at a
time by that engine, so a new hook cannot be silently skipped there; one with state the
engine cannot stack (DiLoCo's persistent inner optimizer) says why in ``not_batchable``.

The per-step hooks are elementwise on a parameter and its gradient, and tensors they add to
a gradient are distributed like the parameter (``like``), so they run unchanged on sharded
parameters (FSDP2's ``DTensor``) and after DDP's gradient all-reduce.

A new algorithm is one subclass with a ``name``, passed to ``register``.

This module is the registry (``ALGORITHMS``, ``register``, ``algorithm_of``); the contract is
``fedgrid.client.algorithm_hooks`` and the built-ins live by family (``fedavg_training``,
``diloco_training``, ``block_training``). Every name is importable from here.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

from fedgrid.client.algorithm_hooks import ClientAlgorithm, FitContext, Loop, OptimizerFactory, Trainer
from fedgrid.client.algorithm_math import (
    ProximalTerm,
    ScaffoldControl,
    full,
    like,
    merge,
    names_under,
    train_only,
)
from fedgrid.client.block_training import BlockCoordinateTraining
from fedgrid.client.diloco_training import DiLoCoTraining, StreamingDiLoCoTraining
from fedgrid.client.fedavg_training import FedAvgTraining, FedProxTraining, ScaffoldTraining
from fedgrid.types import Scalar

__all__ = [
    "ALGORITHMS",
    "BlockCoordinateTraining",
    "ClientAlgorithm",
    "DiLoCoTraining",
    "FedAvgTraining",
    "FedProxTraining",
    "FitContext",
    "Loop",
    "OptimizerFactory",
    "ProximalTerm",
    "ScaffoldTraining",
    "ScaffoldControl",
    "StreamingDiLoCoTraining",
    "Trainer",
    "algorithm_of",
    "full",
    "like",
    "merge",
    "names_under",
    "register",
    "train_only",
]

A = TypeVar("A", bound=type[ClientAlgorithm])

#: ``algorithm`` value -> its client half; ``register`` adds one (absent means ``fedavg``).
ALGORITHMS: dict[str, type[ClientAlgorithm]] = {}


def register(cls: A) -> A:
    """Adds ``cls`` to ``ALGORITHMS`` under ``cls.name`` (usable as a class decorator).

    Raises:
        ValueError: no name, or the name is another class's.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name (the task config's 'algorithm' value that selects it)")
    if ALGORITHMS.get(cls.name, cls) is not cls:
        raise ValueError(f"algorithm {cls.name!r} is already {ALGORITHMS[cls.name].__name__}'s")
    ALGORITHMS[cls.name] = cls
    return cls


def algorithm_of(config: Mapping[str, Scalar]) -> str:
    """The task's algorithm (``fedavg`` when the config names none).

    Raises:
        ValueError: an algorithm this client does not implement.
    """
    name = str(config.get("algorithm", "fedavg"))
    if name not in ALGORITHMS:
        raise ValueError(f"task asks for algorithm {name!r}; this client implements {', '.join(ALGORITHMS)}")
    return name


#: The built-in algorithms, registered in the order an unknown algorithm's error lists them.
_BUILT_IN = (
    FedAvgTraining,
    FedProxTraining,
    ScaffoldTraining,
    DiLoCoTraining,
    StreamingDiLoCoTraining,
    BlockCoordinateTraining,
)
for _algorithm in _BUILT_IN:
    register(_algorithm)
