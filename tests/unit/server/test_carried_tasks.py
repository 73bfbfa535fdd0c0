"""A task carried past its quorum survives a restart with what each client must send back: a
streaming DiLoCo task expects its fragment, not the whole model (``server/late_results.py``)."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import torch

from fedgrid.clock import MONOTONIC
from fedgrid.events import EventLog
from fedgrid.fleet.downlink import RoundDownlink
from fedgrid.proto import serde
from fedgrid.server.late_results import CarriedTasks
from fedgrid.server.rounds import RoundTask
from fedgrid.server.spill import UpdateSpill
from fedgrid.types import ClientInfo, FitIns, TensorSpec


def test_a_carried_fragment_task_expects_its_fragment_after_a_restart(tmp_path):
    base = OrderedDict([("a", torch.zeros(2)), ("b", torch.ones(3)), ("c", torch.zeros(1))])
    specs = TensorSpec.of(base)
    fragment = FitIns(round=3, config={"fragment": 1}, expected=OrderedDict((n, specs[n]) for n in ("b",)))
    whole = FitIns(round=3, config={})
    clients = {cid: ClientInfo(client_id=cid, name=f"n-{cid}", num_examples=5) for cid in ("x", "y")}
    rnd = RoundTask(
        server_round=3,
        task_id="t3",
        kind="fit",
        assignments={"x": fragment, "y": whole},
        clients=clients,
        deadline=MONOTONIC.now() + 60,
        downlink=RoundDownlink(base=base, version=0, _full=serde.EncodedModel(base)),
        expected=dict(specs),
        closed=True,
        closed_by="quorum",
        carried={"x", "y"},
    )
    membership = SimpleNamespace(clock=MONOTONIC, records={})
    before = CarriedTasks(membership, UpdateSpill(tmp_path / "spill"), EventLog())  # type: ignore[arg-type]
    before.tasks[rnd.task_id] = rnd
    after = CarriedTasks(membership, UpdateSpill(tmp_path / "spill"), EventLog())  # type: ignore[arg-type]
    after.load(before.state_list(), grace_s=1.0)
    restored = after.tasks["t3"]
    assert restored.carried == {"x", "y"}
    assert restored.assignments["x"].expected == OrderedDict([("b", specs["b"])])
    assert restored.assignments["y"].expected is None  # the whole model, as before
