"""Downloads: the model of a client's open task, as a chunk stream, counted as it goes.

A client downloads the whole model, or on a lossless downlink the tensors its task names
(``FitIns.download``, plus what a difference-sending uplink is taken against), or on a
compressed downlink the change since the version it holds (``fleet/downlink.py``); a client
of another LoRA rank than the model's downloads the model refactorized to its rank, whole
(``fedgrid.aggregation.lora_ranks``). The
wire bytes go to the round's ``RoundTally`` (``fleet/protocol.py``) whether or not the stream
completes, and the client counts as alive while it downloads (``Membership.live``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator

from fedgrid.errors import StaleTaskError
from fedgrid.fleet.downlink import Downlink
from fedgrid.fleet.protocol import download_names
from fedgrid.proto import serde
from fedgrid.server.membership import Membership
from fedgrid.server.rounds import RoundTask
from fedgrid.textsafe import escape
from fedgrid.types import FitIns

__all__ = ["Downloads"]


class Downloads:
    """The download handler of a fleet.

    Args:
        membership: authenticates the client (its lock is the fleet's).
        downlink: the fleet's downlink policy (whether it is lossless, its codec).
        open_task: the fleet's check that a client has the open task ``task_id`` (lock held).
        run_id: the fleet's run id, named in every stream's header.
        chunk_size: the fleet's payload bytes per chunk.
    """

    def __init__(
        self,
        membership: Membership,
        downlink: Downlink,
        open_task: Callable[[str, str], RoundTask],
        *,
        run_id: Callable[[], str],
        chunk_size: Callable[[], int],
    ) -> None:
        self.membership = membership
        self.lock = membership.lock
        self.downlink = downlink
        self._open_task = open_task
        self._run_id = run_id
        self._chunk_size = chunk_size

    def download(
        self, client_id: str, token: str, task_id: str, have_version: int | None = None
    ) -> Iterator[bytes]:
        """The model of the client's open task, as a chunk stream: whole, or the tensors its task
        names (``FitIns.download``) on a lossless downlink, or on a compressed downlink the
        change since ``have_version`` when the client holds the previous version."""
        self.membership.authenticate(client_id, token)
        with self.lock:
            rnd = self._open_task(client_id, task_id)
        if rnd.downlink is None:
            raise StaleTaskError(
                f"task {escape(task_id)} is message phase {rnd.kind!r}: it has no model to download"
            )
        names = self._names(rnd, client_id)
        ranked = rnd.at_rank(client_id)  # a client of its own LoRA rank: the model at that rank, whole
        if ranked is not None:
            encoded, delta, base_version = serde.EncodedModel(ranked[0], codec=self.downlink.codec), False, 0
        elif names is None:
            encoded, delta, base_version = rnd.downlink.for_client(have_version)
        else:
            encoded, delta, base_version = self._part(rnd, names), False, 0
        info = serde.StreamInfo(
            run_id=self._run_id(),
            task_id=task_id,
            round=rnd.server_round,
            delta=delta,
            version=rnd.downlink.version,
            base_version=base_version,
        )
        return self._counted(rnd, encoded.frames(info, chunk_size=self._chunk_size()), client_id)

    def _names(self, rnd: RoundTask, client_id: str) -> frozenset[str] | None:
        ins = rnd.assignments[client_id]
        if not isinstance(ins, FitIns):
            return None
        # An uplink sending differences takes them against the global values of what it uploads.
        return download_names(
            ins, lossless_downlink=self.downlink.lossless, codec=rnd.uplink_codec(client_id)
        )

    def _part(self, rnd: RoundTask, names: frozenset[str]) -> serde.EncodedModel:
        """The tensors ``names`` of the round's exact model, encoded once per round and set of
        tensors (two clients racing may both encode it; one copy is kept)."""
        with self.lock:
            part = rnd.parts.get(names)
        if part is None:
            tensors = OrderedDict((n, t) for n, t in rnd.global_state.items() if n in names)
            part = serde.EncodedModel(tensors, codec=self.downlink.codec)
            with self.lock:
                part = rnd.parts.setdefault(names, part)
        return part

    def _counted(self, rnd: RoundTask, frames: Iterator[bytes], client_id: str) -> Iterator[bytes]:
        """``frames``, counted; the client counts as alive while it downloads (``Membership.live``)."""
        sent = 0
        region = rnd.clients[client_id].region
        with self.lock:
            record = self.membership.records.get(client_id)
            if record is not None:
                record.transfers += 1
        try:
            for frame in frames:
                sent += serde.wire_size(frame)
                yield frame
        finally:
            with self.lock:
                if record is not None:
                    record.transfers -= 1
                    record.last_seen = self.membership.clock.now()
                rnd.tally.add_down(region, sent)
