"""Compressed downlink: every client holds the coordinator's shadow bit for bit; a client
that missed a round catches up with the whole model."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import torch

from fedgrid.client.runtime import Connection
from fedgrid.compression.spec import CodecSpec
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.types import FitIns

from harness import wait_until
from harness_clients import Named


def test_clients_hold_the_shadow_and_catch_up():
    g = torch.Generator().manual_seed(5)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60), downlink_codec=CodecSpec.parse("topk:0.2"))
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16).start()
    conns = [Connection(server.address) for _ in range(2)]
    try:
        for i, c in enumerate(conns):
            c.join(Named(f"c{i}"))
        infos = {info.name: info for info in fleet.live_clients()}
        model = OrderedDict(
            w=torch.randn(200, 5, generator=g), b=torch.randn(5, generator=g), n=torch.tensor(3)
        )
        import threading

        for server_round in range(1, 5):
            model = OrderedDict(
                (k, v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 1)
                for k, v in model.items()
            )
            # c1 sits out round 2, so in round 3 it needs a catch-up.
            active = [i for i in range(2) if not (i == 1 and server_round == 2)]
            assignments = [(infos[f"c{i}"], FitIns(round=server_round)) for i in active]
            out: list = []
            t = threading.Thread(
                target=lambda: out.append(
                    fleet.fit_round(
                        server_round=server_round,
                        global_state=model,
                        assignments=assignments,
                        timeout=timedelta(seconds=60),
                    )
                )
            )
            t.start()
            wait_until(
                lambda: fleet.current_round is not None and fleet.current_round.server_round == server_round,
                timeout=10,
                what="round",
            )
            for i in active:
                task = conns[i].poll(5).task
                held = conns[i].fetch_model(task.task_id)
                shadow = fleet.downlink.shadow.shadow
                for name in model:
                    assert torch.equal(held[name], shadow[name]), (server_round, i, name)
                assert conns[i].held_version == fleet.current_round.downlink.version
                conns[i].upload(task.task_id, server_round, held, 1, {})
            t.join(timeout=30)
            down = out[0].bytes_down
            if server_round == 3:  # c0 gets a difference, c1 (missed round 2) the whole model
                assert down > 200 * 5 * 4
            elif server_round in (2, 4):
                assert down < len(active) * 200 * 5 * 4 / 2
        # The shadow trails the global model by exactly the carried residual.
        gap = fleet.downlink.shadow.gap(model)
        assert float(gap["w"].abs().max()) > 0
    finally:
        for c in conns:
            c.close()
        server.stop(grace=0.5)
        fleet.close()
