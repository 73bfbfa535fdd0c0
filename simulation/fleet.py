"""``InProcessFleet``: clients run one after another in this process.

Models cross the same serialization as on the wire (``fedgrid.proto.serde``), so a
simulated run moves the same bytes, and produces the same bits, as a deployed one.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
import logging
from datetime import timedelta
from typing import Sequence

from fedgrid.client.api import Client
from fedgrid.client.uplink import UplinkEncoder, reconstruct
from fedgrid.compression import available_codecs
from fedgrid.server.codec_policy import CodecPolicy
from fedgrid.server.downlink import Downlink
from fedgrid.proto import serde
from fedgrid.server.fleet import Fleet, RoundOutcome
from fedgrid.types import ClientInfo, EvaluateIns, EvaluateRes, FitIns, FitRes, Failure, ModelState, TensorSpec

__all__ = ["InProcessFleet"]

log = logging.getLogger(__name__)


class InProcessFleet(Fleet):
    """Runs ``clients`` sequentially in process.

    Args:
        clients: the simulated clients; ``name`` must be unique (it is the ordering key).
        chunk_size: chunk size of the simulated wire.
    """

    def __init__(
        self,
        clients: Sequence[Client],
        *,
        chunk_size: int = serde.CHUNK_SIZE,
        codec_policy: CodecPolicy | None = None,
        downlink_codec: str = "none",
    ) -> None:
        self._clients: dict[str, Client] = {}
        self._infos: list[ClientInfo] = []
        codecs = tuple(available_codecs())
        for i, client in enumerate(clients):
            cid = f"sim-{i:05d}"
            self._clients[cid] = client
            self._infos.append(
                ClientInfo(client_id=cid, name=client.name or cid, region=client.region, num_examples=client.num_examples, codecs=codecs)
            )
        self.chunk_size = chunk_size
        self.codec_policy = codec_policy or CodecPolicy()
        self._uplinks: dict[tuple[str, str], UplinkEncoder] = {}  # per client and codec, as each client process keeps
        self.downlink = Downlink(downlink_codec)
        self._held: dict[str, int] = {}  # downlink version each client holds

    def _uplink(self, client_id: str, codec: str) -> UplinkEncoder:
        key = (client_id, codec)
        if key not in self._uplinks:
            self._uplinks[key] = UplinkEncoder(codec)
        return self._uplinks[key]

    def wait_for_clients(self, *, min_clients: int, timeout: timedelta) -> list[ClientInfo]:
        if len(self._infos) < min_clients:
            raise TimeoutError(f"simulation has {len(self._infos)} clients, fewer than min_clients={min_clients}")
        return list(self._infos)

    def fit_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, FitIns]],
        timeout: timedelta,
        target: int | None = None,
    ) -> RoundOutcome[FitRes]:
        downlink = self.downlink.prepare(global_state)
        base = downlink.base  # what clients hold after downloading: differences apply to it
        expected = TensorSpec.of(global_state)
        results: list[FitRes] = []
        failures: list[Failure] = []
        bytes_up = bytes_down = raw_up = payload_up = 0
        goal = len(assignments) if target is None else target
        cancelled: list[ClientInfo] = []
        for info, ins in assignments:
            if len(results) >= goal:  # sequential clients finish in order: the rest are not needed
                cancelled.append(info)
                continue
            encoded, delta, base_version = downlink.for_client(self._held.get(info.client_id))
            head = serde.StreamInfo(round=server_round, delta=delta, version=downlink.version, base_version=base_version)
            down = list(encoded.frames(head, chunk_size=self.chunk_size))
            bytes_down += sum(serde.wire_size(c) for c in down)
            # A client applying a difference to the version it holds reaches ``base`` bit for
            # bit (ShadowModel runs the clients' apply_delta), so hand it a copy of ``base``.
            state = OrderedDict((k, v.clone()) for k, v in base.items()) if delta else serde.decode_chunks(down)[1]
            if downlink.version:
                self._held[info.client_id] = downlink.version
            try:
                codec = self.codec_policy.uplink(info)
                task = dataclasses.replace(ins, config={**ins.config, "uplink_codec": codec})
                out = self._clients[info.client_id].fit(state, task)
                encoded_up, delta_up = self._uplink(info.client_id, codec).encode(global_state=state, new_state=out.state)
                info_up = serde.StreamInfo(round=server_round, num_examples=out.num_examples, metrics=out.metrics, delta=delta_up)
                up = list(encoded_up.frames(info_up, chunk_size=self.chunk_size))
                header, received = serde.decode_chunks(up, expected=ins.expected or expected)
                update = reconstruct(base, received, delta=header.delta)
                serde.check_finite(update)
            except Exception as exc:  # a client's failure is data for the strategy
                log.warning("client %s failed in round %d: %s", info.name, server_round, exc)
                failures.append(Failure(info, f"{type(exc).__name__}: {exc}"))
                continue
            bytes_up += sum(serde.wire_size(c) for c in up)
            payload_up += encoded_up.total_bytes
            raw_up += sum(t.numel() * t.element_size() for t in update.values())
            results.append(FitRes(info, update, header.num_examples, header.metrics))
        extra = {"uplink_ratio": raw_up / payload_up} if payload_up else {}
        return RoundOutcome(results, failures, cancelled, bytes_up=bytes_up, bytes_down=bytes_down, extra=extra)

    def evaluate_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
        timeout: timedelta,
    ) -> RoundOutcome[EvaluateRes]:
        encoded = serde.EncodedModel(global_state)
        results: list[EvaluateRes] = []
        failures: list[Failure] = []
        bytes_up = bytes_down = 0
        for info, ins in assignments:
            down = list(encoded.frames(serde.StreamInfo(round=server_round), chunk_size=self.chunk_size))
            bytes_down += sum(serde.wire_size(c) for c in down)
            _, state = serde.decode_chunks(down)
            try:
                out = self._clients[info.client_id].evaluate(state, ins.config)
                info_up = serde.StreamInfo(round=server_round, num_examples=out.num_examples, metrics=out.metrics)
                up = list(serde.EncodedModel({}).frames(info_up))
                header, _ = serde.decode_chunks(up, expected={})
            except Exception as exc:  # a client's failure is data for the strategy
                failures.append(Failure(info, f"{type(exc).__name__}: {exc}"))
                continue
            bytes_up += sum(serde.wire_size(c) for c in up)
            if header.num_examples < 1:
                failures.append(Failure(info, "evaluated no examples"))
                continue
            results.append(EvaluateRes(info, header.num_examples, header.metrics))
        return RoundOutcome(results, failures, bytes_up=bytes_up, bytes_down=bytes_down)
