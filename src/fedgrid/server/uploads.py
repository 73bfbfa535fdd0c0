"""Uploads: receiving a client's update stream, checking it as it arrives, spilling it,
keeping a broken one for its resume, and answering where a broken one stands.

Every frame is checked before it touches state (``serde.ModelAssembler``: sizes, checksums,
the expected specs); a fit update's tensors are checked as they complete and written to
their spill file. An update is accepted whole or not at all.

Before any tensor is read, the header must name this run (``run_id``: the id the client got
at Join) and pass ``fleet/protocol.py``'s header checks (the ``delta`` flag against the
negotiated uplink codec, ``num_examples`` against its bounds); each tensor must come in the
task's uplink codec (``ModelAssembler``'s ``codec``: an integer or bool tensor may come raw)
and pass its ``UpdateCheck`` (finite, within the norm bound), and the bytes go to the round's
``RoundTally``. The simulated fleets take the same checks, so a simulated run refuses what
a deployment refuses. Each refusal is INVALID_ARGUMENT naming the numbers or ids, and
changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch

from fedgrid.errors import DuplicateUpdateError, FedgridError, InvalidUpdateError, StaleTaskError
from fedgrid.events import EventLog
from fedgrid.fleet import protocol
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.proto import serde
from fedgrid.server.membership import ClientRecord, Membership
from fedgrid.server.rounds import RoundTask
from fedgrid.server.spill import UpdateSpill, UpdateWriter
from fedgrid.textsafe import escape
from fedgrid.types import ClientInfo, EvaluateRes, Failure, FitRes, ModelState, TensorSpec

__all__ = ["Upload", "Uploads"]

log = logging.getLogger(__name__)


@dataclass
class Upload:
    """An upload in progress (or broken, awaiting its resume)."""

    asm: serde.ModelAssembler
    writer: UpdateWriter | None
    raw_bytes: int  # its size uncompressed
    client_id: str = ""
    delta: bool = False  # its fit result holds differences (FitRes.delta)
    kept: bool = False  # held in the round's partials for a resume: not aborted when the call ends
    shifted: bool = False  # its differences carry the downlink's offset (``protocol.update_check``)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


class Uploads:
    """The upload handlers of a fleet.

    Args:
        membership: authenticates the uploader (its lock and wake-ups are the fleet's).
        spill: where accepted fit updates go.
        events: where accepted and broken uploads are reported.
        open_task: the fleet's check that a client has the open task ``task_id`` (lock held).
        current: the fleet's open task, or ``None``.
        bounds: the weight and norm bounds every update must meet.
        run_id: the fleet's run id (it changes when a restarted coordinator loads its state).
        late_refusal: why a late upload to a task carried past its round's quorum cannot be
            merged (too stale), or ``None`` (lock held).
    """

    def __init__(
        self,
        membership: Membership,
        spill: UpdateSpill,
        events: EventLog,
        open_task: Callable[[str, str], RoundTask],
        current: Callable[[], RoundTask | None],
        *,
        bounds: UpdateBounds | None = None,
        run_id: Callable[[], str] = lambda: "",
        late_refusal: Callable[[RoundTask], str | None] = lambda rnd: None,
    ) -> None:
        self.membership = membership
        self.bounds = bounds if bounds is not None else UpdateBounds()
        self._run_id = run_id
        self.lock = membership.lock
        self.wake = membership.wake
        self.spill = spill
        self.events = events
        self._open_task = open_task
        self._current = current
        self._late_refusal = late_refusal

    def upload(self, frames: Iterable[bytes], token: str) -> int:
        """Receives one update stream of the session ``token``; returns the payload bytes accepted.

        Raises:
            InvalidUpdateError: malformed stream or tensors, another run's id, a ``delta``
                flag that does not match the task's codec, a weight or norm over its bound
                (state unchanged; the checks are ``fleet/protocol.py``'s).
            AuthenticationError, StaleTaskError, DuplicateUpdateError: as named.
        """
        iterator = iter(frames)
        first = next(iterator, None)
        if first is None:
            raise InvalidUpdateError("empty upload stream: no header")
        header = serde.read_header(first)
        record = self.membership.authenticate(header.client_id, token)
        client_id = record.info.client_id
        run_id = self._run_id()
        if header.run_id != run_id:
            raise InvalidUpdateError(
                f"run_id: the upload names run {escape(header.run_id)}, this coordinator runs {run_id!r}"
            )
        rnd = self._open_upload(record, header)
        upload: Upload | None = None
        try:
            upload = self._resume_or_start(rnd, record, header, first)
            self._receive(rnd, record, upload, iterator)
            stream, state = self._finish(rnd, upload)
            if stream.round != rnd.server_round:
                raise InvalidUpdateError(
                    f"header names round {stream.round}, the task is round {rnd.server_round}"
                )
            result = self._result(rnd, record.info, upload, stream, state)
            del state
            self._count(rnd, record.info, upload, result)
            accepted, upload = upload, None
            return accepted.asm.payload_bytes
        finally:
            if upload is not None and not upload.kept:  # rejected: drop what was written
                upload.abort()
            with self.lock:
                rnd.uploading.discard(client_id)
                record.transfers -= 1
                record.last_seen = self.membership.clock.now()
                self.wake.notify("round", ("upload", client_id))

    def _open_upload(self, record: ClientRecord, header: serde.StreamInfo) -> RoundTask:
        """The open task the upload is for, marked as uploading (lock taken here)."""
        client_id = record.info.client_id
        with self.lock:
            current = self._current()
            if current is not None and current.task_id == header.task_id and current.landed(client_id):
                # Checked before "closed": a retry whose first attempt landed learns it did.
                raise DuplicateUpdateError(
                    f"update for round {current.server_round} from client {escape(client_id)} already accepted"
                )
            if record.benched_task == header.task_id:  # late, but it did finish that task
                record.benched_task = ""
            rnd = self._open_task(client_id, header.task_id)
            if rnd.landed(client_id):
                raise DuplicateUpdateError(
                    f"update for round {rnd.server_round} from client {escape(client_id)} already accepted"
                )
            refusal = self._late_refusal(rnd) if rnd.closed else None
            if refusal is not None:  # too stale to merge: the task ends here, the client goes on
                rnd.carried.discard(client_id)
                partial = rnd.partials.pop(client_id, None)
                if partial is not None:
                    partial.abort()
                self.wake.notify("membership")
                self.events.emit("late_refused", round=rnd.server_round, client=client_id, reason=refusal)
                raise StaleTaskError(refusal)
            if client_id in rnd.failures:  # it reported a failure, left, or was given up
                raise StaleTaskError(
                    f"round {rnd.server_round}: this task already failed ({rnd.failures[client_id].reason})"
                )
            if rnd.is_message:
                raise StaleTaskError(
                    f"task {escape(header.task_id)} is message phase {rnd.kind!r}: it takes SendMessages, not an upload"
                )
            if not rnd.evaluate:
                protocol.check_delta(rnd.uplink_codec(client_id), header.delta)
            if client_id in rnd.uploading:
                raise DuplicateUpdateError(
                    f"an upload for round {rnd.server_round} from client {escape(client_id)} is in progress"
                )
            rnd.uploading.add(client_id)
            record.transfers += 1
        return rnd

    def _resume_or_start(
        self, rnd: RoundTask, record: ClientRecord, header: serde.StreamInfo, first: bytes
    ) -> Upload:
        """The broken upload this one resumes, or a new one fed its first frame."""
        client_id = record.info.client_id
        with self.lock:
            partial = rnd.partials.pop(client_id, None)
        if header.resume_from_chunk:
            if partial is None or partial.asm.frames_received != header.resume_from_chunk:
                held = 0 if partial is None else partial.asm.frames_received
                if partial is not None:
                    with self.lock:
                        rnd.partials[client_id] = partial
                raise StaleTaskError(
                    f"cannot resume at chunk {header.resume_from_chunk}: "
                    f"the coordinator holds {held} chunks of this upload"
                )
            partial.kept = False
            return partial
        if partial is not None:
            partial.abort()
        upload = self._start(rnd, record.info, header)
        upload.asm.feed(first)
        return upload

    def _keep(self, rnd: RoundTask, client_id: str, upload: Upload) -> None:
        """Keeps a broken upload for its resume (unless the round closed)."""
        with self.lock:
            if rnd.open_for(client_id):
                rnd.partials[client_id] = upload
                upload.kept = True

    def _receive(self, rnd: RoundTask, record: ClientRecord, upload: Upload, frames: Iterator[bytes]) -> None:
        """Feeds the rest of the stream; a broken connection keeps what arrived for the resume."""
        try:
            for frame in frames:
                upload.asm.feed(frame)
        except FedgridError:
            raise  # bad input: nothing kept
        except Exception:
            self._keep(rnd, record.info.client_id, upload)
            chunks = upload.asm.frames_received
            log.info(
                "round %d: upload from %s broke after %d chunks; kept for resume",
                rnd.server_round,
                escape(record.info.name or record.info.client_id),
                chunks,
            )
            self.events.emit(
                "upload_broken", round=rnd.server_round, client=record.info.client_id, chunks=chunks
            )
            raise

    def _finish(self, rnd: RoundTask, upload: Upload) -> tuple[serde.StreamInfo, ModelState]:
        try:
            return upload.asm.finish()
        except InvalidUpdateError:
            # A cut connection can look like a stream that ended: keep what was verified so
            # that the client resumes from it (the sender hears the error either way).
            if upload.asm.ended_early:
                self._keep(rnd, upload.client_id, upload)
            raise

    def _result(
        self, rnd: RoundTask, client: ClientInfo, upload: Upload, stream: serde.StreamInfo, state: ModelState
    ) -> FitRes | EvaluateRes:
        """The result the upload delivers (a fit update spilled)."""
        metrics = dict(stream.metrics)
        if rnd.evaluate:
            return EvaluateRes(client, stream.num_examples, metrics)
        if upload.writer is not None:  # tensors were checked and written as they came
            state = upload.writer.commit()  # type: ignore[assignment]
            return FitRes(client, state, stream.num_examples, metrics, upload.delta)
        check = self._check(rnd, client.client_id, stream.delta)
        upload.shifted = check.shifts
        result = FitRes(client, check.whole(state), stream.num_examples, metrics, check.keeps_delta)
        return self.spill.put(task_id=rnd.task_id, result=result)

    def _check(self, rnd: RoundTask, client_id: str, delta: bool) -> protocol.UpdateCheck:
        """The check of a fit update and the form it is kept in (``protocol.update_check``): late
        when its task was carried past its round's quorum."""
        ranked = rnd.at_rank(client_id)
        assert rnd.downlink is not None  # a fit phase
        with self.lock:
            late = client_id in rnd.carried
        return protocol.update_check(
            rnd.downlink, self.bounds, delta=delta, ranked=None if ranked is None else ranked[0], late=late
        )

    def _count(
        self, rnd: RoundTask, client: ClientInfo, upload: Upload, result: FitRes | EvaluateRes
    ) -> None:
        """Adds the result to the round if it is still open for it (lock taken here)."""
        client_id = client.client_id
        with self.lock:
            late = client_id in rnd.carried
            still_open = late or (not rnd.closed and self._current() is rnd)
            failed = rnd.failures.get(client_id)
            if not still_open or failed is not None:
                if not rnd.evaluate:
                    self.spill.discard(task_id=rnd.task_id, client_id=client_id)
                if failed is not None:  # it left or reported a failure while uploading
                    raise StaleTaskError(
                        f"round {rnd.server_round}: this task failed during the upload ({failed.reason})"
                    )
                raise StaleTaskError(f"round {rnd.server_round} closed before the upload completed")
            if isinstance(result, EvaluateRes) and result.num_examples < 1:
                rnd.failures[client_id] = Failure(client, "evaluated no examples")
            elif late and isinstance(result, FitRes):  # merged into the round open now, or the next
                if upload.shifted:  # begun on time, it landed after the quorum: its own change again
                    assert rnd.downlink is not None and rnd.downlink.offset is not None
                    result = protocol.without_offset(result, rnd.downlink.offset)
                rnd.carried.discard(client_id)
                rnd.late[client_id] = result
                self.wake.notify("membership")  # no longer busy: selectable again
            else:
                rnd.results[client_id] = result
            asm = upload.asm
            rnd.tally.add_up(
                client.region, wire=asm.wire_bytes, payload=asm.payload_bytes, raw=upload.raw_bytes
            )
            self.wake.notify("round")
            accepted, expected = len(rnd.results), len(rnd.assignments)
        log.info(
            "round %d: accepted %s%s from %s (%d of %d)",
            rnd.server_round,
            "late " if late else "",
            "evaluation" if rnd.evaluate else "update",
            escape(client.name or client_id),
            accepted,
            expected,
        )
        self.events.emit(
            "update_accepted",
            round=rnd.server_round,
            client=client_id,
            evaluate=rnd.evaluate,
            accepted=accepted,
            expected=expected,
            **({"late": True} if late else {}),
        )

    def _start(self, rnd: RoundTask, client: ClientInfo, header: serde.StreamInfo) -> Upload:
        """An assembler for a new upload; fit updates stream into their spill file."""
        ins = rnd.assignments[client.client_id]
        # The expected specs bound every allocation; an evaluation carries no tensors.
        ranked = None if rnd.evaluate else rnd.at_rank(client.client_id)
        expected: Mapping[str, TensorSpec] = (
            {} if rnd.evaluate else ranked[1] if ranked else (getattr(ins, "expected", None) or rnd.expected)
        )
        raw = protocol.raw_bytes(expected)
        protocol.check_claim(self.bounds, client, header.num_examples, evaluate=rnd.evaluate)
        if rnd.evaluate:
            return Upload(serde.ModelAssembler(expected=expected), None, raw, client.client_id)
        check = self._check(rnd, client.client_id, header.delta)
        writer = self.spill.writer(
            task_id=rnd.task_id,
            client=client,
            specs=expected,
            num_examples=header.num_examples,
            metrics=header.metrics,
            delta=check.keeps_delta,
        )
        codec = rnd.uplink_codec(client.client_id)  # every tensor comes in it (or raw, where it may)
        if writer is None:
            return Upload(serde.ModelAssembler(expected=expected, codec=codec), None, raw, client.client_id)

        def sink(name: str, tensor: torch.Tensor) -> None:
            writer.write(name, check.add(name, tensor))

        asm = serde.ModelAssembler(expected=expected, sink=sink, codec=codec)
        return Upload(asm, writer, raw, client.client_id, check.keeps_delta, shifted=check.shifts)

    def status(self, client_id: str, token: str, task_id: str) -> tuple[int, bool]:
        """(chunks of a broken upload the coordinator holds, whether the update already landed)."""
        self.membership.authenticate(client_id, token)
        with self.lock:
            rnd = self._current()
            if rnd is not None and rnd.task_id == task_id and rnd.landed(client_id):
                return 0, True
            rnd = self._open_task(client_id, task_id)
            # A broken stream may still be winding down on its server thread: let it settle.
            deadline = self.membership.clock.now() + 5.0
            while client_id in rnd.uploading and self.membership.clock.now() < deadline:
                self.wake.wait_until(("upload", client_id), deadline)
            if rnd.landed(client_id):
                return 0, True
            partial = rnd.partials.get(client_id)
            return (0 if partial is None else partial.asm.frames_received), False
