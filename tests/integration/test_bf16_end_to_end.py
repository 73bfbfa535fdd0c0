"""A model given in bf16 stays bf16 end to end (issue 40, item 1): the client trains it in bf16
(its gradients and AdamW's moments too), uploads bf16 through the fp4 uplink, the coordinator
accepts it into a ``RemoteFleet`` and DiLoCo's outer step returns a bf16 model; only the outer
momentum, which DiLoCo needs precise, is float32. The checkpoint keeps both dtypes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from fedgrid.aggregation.diloco import DiLoCo
from fedgrid.client.torch_client import TorchClient
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.spec import CodecSpec
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.proto import serde
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.state import StateStore
from fedgrid.types import ClientInfo, FitIns

from harness import wait_until

pytestmark = pytest.mark.timeout(120)


def test_a_bf16_model_stays_bf16_from_the_client_through_the_outer_step_and_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16)
    inputs, targets = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)
    client = TorchClient(
        model,
        [(inputs, targets)] * 2,
        nn.functional.mse_loss,
        lambda p: torch.optim.SGD(p, lr=0.1),
        device="cpu",
    )
    strategy = DiLoCo(outer_lr=0.7, outer_momentum=0.9)
    strategy.initialize(
        initial_state=OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    )
    fp4 = CodecSpec.parse("fp4")
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=600), codec_policy=CodecPolicy(default=fp4))
    try:
        info, token = fleet.join(ClientInfo("", name="site-a", num_examples=8, codecs=("fp4",)))
        outcome: list[Any] = []
        thread = threading.Thread(
            target=lambda: outcome.append(
                fleet.fit_round(
                    server_round=1,
                    global_state=strategy.global_state,
                    assignments=[(info, FitIns(round=1))],
                    timeout=timedelta(seconds=60),
                )
            ),
            daemon=True,
        )
        thread.start()
        wait_until(lambda: fleet.current_round is not None, timeout=30, what="round 1's task")
        config = {"algorithm": "diloco", "inner_steps": 2}
        download = strategy.global_state
        out = client.fit(download, FitIns(round=1, config=config))
        # The client trained in bf16: its parameters, their gradients' optimizer moments, its upload.
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        moments = [t for s in client.inner_optimizer.state.values() for t in s.values() if t.dim()]
        assert moments and {t.dtype for t in moments} == {torch.bfloat16}
        assert {t.dtype for t in out.state.values()} == {torch.bfloat16}
        encoded, delta = (
            UplinkEncoder(fp4).begin(1, config, "site-a").encode(global_state=download, new_state=out.state)
        )
        stream = serde.StreamInfo(
            run_id=fleet.run_id,
            task_id=fleet.current_round.task_id,  # type: ignore[union-attr]
            round=1,
            client_id=info.client_id,
            num_examples=8,
            delta=delta,
        )
        fleet.upload(encoded.frames(stream), token)
        thread.join(60)
        results = outcome[0].results
        assert len(results) == 1 and {t.dtype for t in results[0].state.values()} == {torch.bfloat16}
        before = OrderedDict((k, v.clone()) for k, v in strategy.global_state.items())
        strategy.aggregate(server_round=1, results=results, failures=[])
    finally:
        fleet.close()

    # The outer step moved the model and left it bf16; the momentum alone is float32.
    assert {t.dtype for t in strategy.global_state.values()} == {torch.bfloat16}
    assert any(not torch.equal(strategy.global_state[k], before[k]) for k in before)
    momentum = strategy.server_optimizer._buffers["momentum"]
    assert set(momentum) == set(before) and {t.dtype for t in momentum.values()} == {torch.float32}

    # The checkpoint keeps both dtypes, bit for bit.
    store = StateStore(tmp_path)
    store.save(server_round=1, strategy=strategy.state_view(), fleet={}, history=[{"round": 1}])
    restored = DiLoCo(outer_lr=0.7, outer_momentum=0.9)
    restored.load_state_dict(store.load(1).strategy)
    for name, tensor in strategy.global_state.items():
        assert restored.global_state[name].dtype == torch.bfloat16 and torch.equal(
            restored.global_state[name], tensor
        )
        assert torch.equal(restored.server_optimizer._buffers["momentum"][name], momentum[name])
