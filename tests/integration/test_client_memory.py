"""A client's memory through DiLoCo tasks on a 20M-parameter model (80 MB in float32), counted in
torch storages from the model's creation on (``StorageMeter``): the download it trains from,
``TorchClient.fit`` (inner steps of the persistent AdamW, the upload's state) and the uplink's
encoding (``UplinkEncoder``: the difference to the download, through the codec and its error
feedback), round after round.

The floor (issue 40, item 1) is 6x the model: the model, AdamW's two moments, the gradients and
one snapshot. What the uplink's error feedback adds is stated and bounded here too. Each bound
has less than one model of room: a full-model copy added anywhere on the path fails the test.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from fedgrid.client.torch_client import TorchClient
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.spec import CodecSpec
from fedgrid.proto import serde
from fedgrid.types import FitIns

from storage_meter import StorageMeter

pytestmark = pytest.mark.timeout(300)

WIDTH, LAYERS = 707, 40  # 40 matrices of 0.5M: 19.99M parameters


@pytest.mark.parametrize(
    ("codec", "bound"),
    [
        # The model (1x), the download it trains from (1x), AdamW's moments (2x), and the gradients
        # while training (1x), then the upload's state in their place (1x): 5.08x at the peak.
        ("none", 5.5),
        # fp4 with error feedback adds its residual (1x) and, in a deployed client (repeatable),
        # the residuals the latest round began from, kept so a round handed again encodes the
        # same bits (1x): 7.28x from round 2 on.
        ("fp4", 7.5),
    ],
)
def test_a_diloco_client_holds_the_model_optimizer_gradients_and_one_snapshot(codec, bound):
    config = {"algorithm": "diloco", "inner_steps": 1}
    peaks = []
    with StorageMeter() as meter:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        inputs, targets = torch.randn(2, WIDTH), torch.randn(2, WIDTH)
        client = TorchClient(
            model,
            [(inputs, targets)] * 2,
            nn.functional.mse_loss,
            lambda p: torch.optim.SGD(p, lr=0.1),
            device="cpu",
        )
        uplink = UplinkEncoder(CodecSpec.parse(codec))
        for server_round in (1, 2):
            download = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
            meter.peak = meter.now
            out = client.fit(download, FitIns(round=server_round, config=config))
            uplink.begin(server_round, config, "site-a")
            encoded, _ = uplink.encode(global_state=download, new_state=out.state)
            info = serde.StreamInfo(
                run_id="r", task_id="t", round=server_round, client_id="c", num_examples=2
            )
            sent = sum(len(frame) for frame in encoded.frames(info))
            peaks.append(meter.peak / model_bytes)
            del out, encoded, download

    assert model_bytes == 4 * WIDTH * WIDTH * LAYERS
    # The upload went out whole (none: 4 bytes a parameter) or at 4 bits a parameter (fp4).
    assert sent >= (model_bytes if codec == "none" else model_bytes // 8)
    assert sent < (1.01 * model_bytes if codec == "none" else 0.2 * model_bytes)
    assert max(peaks) <= bound, f"the client held {max(peaks):.2f}x the model at its peak (rounds: {peaks})"
    assert min(peaks) >= 5.0, f"{peaks}: the meter missed the client's state"  # the count sees it all
