"""Uploads: receiving a client's update stream, checking it as it arrives, spilling it,
keeping a broken one for its resume, and answering where a broken one stands.

Every frame is checked before it touches state (``serde.ModelAssembler``: sizes, checksums,
the expected specs); a fit update's tensors are reconstructed (differences applied to the
round's model), checked finite, measured against the norm bound and written to their
spill file as they complete. An update is accepted whole or not at all.

Before any tensor is read, the header must name this run (``run_id``: the id the client got
at Join), say ``delta`` exactly when the client's negotiated uplink codec sends differences
(a lossless codec never does: a ``delta`` update on a ``none`` task would be added to the
global model), and claim no more examples than the client reported at Join nor than
``max_num_examples`` (``server/bounds.py``). Each refusal is INVALID_ARGUMENT naming the
numbers or ids, and changes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from fedgrid.compression import parse_codec_spec
from fedgrid.compression.feedback import is_delta_tensor, reconstruct
from fedgrid.errors import DuplicateUpdateError, FedgridError, InvalidUpdateError, StaleTaskError
from fedgrid.events import EventLog
from fedgrid.proto import serde
from fedgrid.server.bounds import UpdateBounds
from fedgrid.server.registry import Registry
from fedgrid.server.rounds import RoundTask
from fedgrid.server.spill import UpdateSpill, UpdateWriter
from fedgrid.textsafe import escape
from fedgrid.types import ClientInfo, EvaluateRes, Failure, FitRes, TensorSpec

__all__ = ["Upload", "Uploads"]

log = logging.getLogger(__name__)


@dataclass
class Upload:
    """An upload in progress (or broken, awaiting its resume)."""

    asm: serde.ModelAssembler
    writer: UpdateWriter | None
    raw_bytes: int  # its size uncompressed

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


class Uploads:
    """The upload handlers of a fleet.

    Args:
        registry: authenticates the uploader (its lock and wake-ups are the fleet's).
        spill: where accepted fit updates go.
        events: where accepted and broken uploads are reported.
        open_task: the fleet's check that a client has the open task ``task_id`` (lock held).
        current: the fleet's open task, or ``None``.
        bounds: the weight and norm bounds every update must meet.
        run_id: the fleet's run id (it changes when a restarted coordinator loads its state).
    """

    def __init__(self, registry: Registry, spill: UpdateSpill, events: EventLog,
                 open_task: Callable[[str, str], RoundTask], current: Callable[[], RoundTask | None], *,
                 bounds: UpdateBounds | None = None, run_id: Callable[[], str] = lambda: "") -> None:
        self.registry = registry
        self.bounds = bounds if bounds is not None else UpdateBounds()
        self._run_id = run_id
        self.lock = registry.lock
        self.wake = registry.wake
        self.spill = spill
        self.events = events
        self._open_task = open_task
        self._current = current

    def upload(self, frames: Iterable[bytes], token: str) -> int:
        """Receives one update stream of the session ``token``; returns the payload bytes accepted.

        Raises:
            InvalidUpdateError: malformed stream or tensors, another run's id, a ``delta``
                flag that does not match the task's codec, a weight or norm over its bound
                (state unchanged).
            AuthenticationError, StaleTaskError, DuplicateUpdateError: as named.
        """
        iterator = iter(frames)
        first = next(iterator, None)
        if first is None:
            raise InvalidUpdateError("empty upload stream: no header")
        header = serde.read_header(first)
        record = self.registry.authenticate(header.client_id, token)
        client_id = record.info.client_id
        run_id = self._run_id()
        if header.run_id != run_id:
            raise InvalidUpdateError(f"run_id: the upload names run {escape(header.run_id)}, this coordinator runs {run_id!r}")
        with self.lock:
            current = self._current()
            if current is not None and current.task_id == header.task_id and client_id in current.results:
                # Checked before "closed": a retry whose first attempt landed learns it did.
                raise DuplicateUpdateError(f"update for round {current.server_round} from client {escape(client_id)} already accepted")
            if record.benched_task == header.task_id:  # late, but it did finish that task
                record.benched_task = ""
            rnd = self._open_task(client_id, header.task_id)
            if client_id in rnd.failures:  # it reported a failure, left, or was given up
                raise StaleTaskError(f"round {rnd.server_round}: this task already failed ({rnd.failures[client_id].reason})")
            if rnd.is_message:
                raise StaleTaskError(f"task {escape(header.task_id)} is message phase {rnd.kind!r}: it takes SendMessages, not an upload")
            if not rnd.evaluate:
                self._check_delta(rnd, client_id, header.delta)
            if client_id in rnd.uploading:
                raise DuplicateUpdateError(f"an upload for round {rnd.server_round} from client {escape(client_id)} is in progress")
            rnd.uploading.add(client_id)
            record.transfers += 1
        upload: Upload | None = None
        try:
            with self.lock:
                partial = rnd.partials.pop(client_id, None)
            if header.resume_from_chunk:
                if partial is None or partial.asm.frames_received != header.resume_from_chunk:
                    held = 0 if partial is None else partial.asm.frames_received
                    if partial is not None:
                        with self.lock:
                            rnd.partials[client_id] = partial
                    raise StaleTaskError(f"cannot resume at chunk {header.resume_from_chunk}: the coordinator holds {held} chunks of this upload")
                upload = partial
            else:
                if partial is not None:
                    partial.abort()
                upload = self._start(rnd, record.info, header)
                upload.asm.feed(first)
            asm = upload.asm
            try:
                for frame in iterator:
                    asm.feed(frame)
            except FedgridError:
                raise  # bad input: nothing kept
            except Exception:
                # The connection broke: keep what arrived so that the client resumes from it.
                with self.lock:
                    if not rnd.closed:
                        rnd.partials[client_id] = upload
                        upload = None  # kept, not aborted
                log.info("round %d: upload from %s broke after %d chunks; kept for resume",
                         rnd.server_round, escape(record.info.name or client_id), asm.frames_received)
                self.events.emit("upload_broken", round=rnd.server_round, client=client_id, chunks=asm.frames_received)
                raise
            try:
                stream, state = asm.finish()
            except InvalidUpdateError:
                # A cut connection can look like a stream that ended: keep what was verified so
                # that the client resumes from it (the sender hears the error either way).
                if asm.ended_early:
                    with self.lock:
                        if not rnd.closed:
                            rnd.partials[client_id] = upload
                            upload = None  # kept, not aborted
                raise
            if stream.round != rnd.server_round:
                raise InvalidUpdateError(f"header names round {stream.round}, the task is round {rnd.server_round}")
            result: FitRes | EvaluateRes
            if rnd.evaluate:
                result = EvaluateRes(record.info, stream.num_examples, dict(stream.metrics))
            elif upload.writer is not None:  # tensors were reconstructed, checked and written as they came
                result = FitRes(record.info, upload.writer.commit(), stream.num_examples, dict(stream.metrics))  # type: ignore[arg-type]
            else:
                state = reconstruct(rnd.global_state, state, delta=stream.delta)
                serde.check_finite(state)
                self.bounds.check_update(state, rnd.global_state)
                result = self.spill.put(task_id=rnd.task_id, result=FitRes(record.info, state, stream.num_examples, dict(stream.metrics)))
            del state
            with self.lock:
                still_open = not rnd.closed and self._current() is rnd
                failed = rnd.failures.get(client_id)
                if not still_open or failed is not None:
                    if not rnd.evaluate:
                        self.spill.discard(task_id=rnd.task_id, client_id=client_id)
                    if failed is not None:  # it left or reported a failure while uploading
                        raise StaleTaskError(f"round {rnd.server_round}: this task failed during the upload ({failed.reason})")
                    raise StaleTaskError(f"round {rnd.server_round} closed before the upload completed")
                if rnd.evaluate and stream.num_examples < 1:
                    rnd.failures[client_id] = Failure(record.info, "evaluated no examples")
                else:
                    rnd.results[client_id] = result
                rnd.bytes_up += asm.wire_bytes
                if record.info.region:
                    rnd.region_bytes.setdefault(record.info.region, [0, 0])[0] += asm.wire_bytes
                rnd.payload_up += asm.payload_bytes
                rnd.raw_up += upload.raw_bytes
                self.wake.notify("round")
                accepted, expected = len(rnd.results), len(rnd.assignments)
            log.info("round %d: accepted %s from %s (%d of %d)", rnd.server_round, "evaluation" if rnd.evaluate else "update",
                     escape(record.info.name or client_id), accepted, expected)
            self.events.emit("update_accepted", round=rnd.server_round, client=client_id, evaluate=rnd.evaluate, accepted=accepted, expected=expected)
            upload = None
            return asm.payload_bytes
        finally:
            if upload is not None:  # rejected: drop what was written
                upload.abort()
            with self.lock:
                rnd.uploading.discard(client_id)
                record.transfers -= 1
                record.last_seen = time.monotonic()
                self.wake.notify("round", ("upload", client_id))

    @staticmethod
    def _check_delta(rnd: RoundTask, client_id: str, delta: bool) -> None:
        """A fit upload carries differences exactly when its task's uplink codec sends them."""
        codec = str(rnd.assignments[client_id].config.get("uplink_codec", "none"))
        sends_differences = not parse_codec_spec(codec, key="uplink_codec").lossless
        if delta != sends_differences:
            raise InvalidUpdateError(
                f"delta: the upload says delta={delta}, the task's uplink codec {codec!r} sends "
                + ("differences (delta=True)" if sends_differences else "whole values (delta=False)")
            )

    def _start(self, rnd: RoundTask, client: ClientInfo, header: serde.StreamInfo) -> Upload:
        """An assembler for a new upload; fit updates stream into their spill file."""
        ins = rnd.assignments[client.client_id]
        # The expected specs bound every allocation; an evaluation carries no tensors.
        expected: Mapping[str, TensorSpec] = {} if rnd.evaluate else (getattr(ins, "expected", None) or rnd.expected)
        raw = sum(spec.nbytes for spec in expected.values())
        self.bounds.check_claim(header.num_examples, joined=client.num_examples, evaluate=rnd.evaluate)
        if rnd.evaluate:
            return Upload(serde.ModelAssembler(expected=expected), None, raw)
        if header.num_examples < 1:
            raise InvalidUpdateError("num_examples must be at least 1")
        writer = self.spill.writer(task_id=rnd.task_id, client=client, specs=expected, num_examples=header.num_examples,
                                   metrics=header.metrics)
        if writer is None:
            return Upload(serde.ModelAssembler(expected=expected), None, raw)
        base = rnd.global_state
        norm = self.bounds.norm(base)  # lives in the assembler: a resumed upload goes on counting

        def sink(name: str, tensor: torch.Tensor) -> None:
            value = base[name] + tensor if header.delta and is_delta_tensor(tensor) else tensor
            serde.check_finite({name: value})
            if norm is not None:
                norm.add(name, value)
            writer.write(name, value)

        return Upload(serde.ModelAssembler(expected=expected, sink=sink), writer, raw)

    def status(self, client_id: str, token: str, task_id: str) -> tuple[int, bool]:
        """(chunks of a broken upload the coordinator holds, whether the update already landed)."""
        self.registry.authenticate(client_id, token)
        with self.lock:
            rnd = self._current()
            if rnd is not None and rnd.task_id == task_id and client_id in rnd.results:
                return 0, True
            rnd = self._open_task(client_id, task_id)
            # A broken stream may still be winding down on its server thread: let it settle.
            deadline = time.monotonic() + 5.0
            while client_id in rnd.uploading and time.monotonic() < deadline:
                self.wake.wait(("upload", client_id), deadline - time.monotonic())
            if client_id in rnd.results:
                return 0, True
            partial = rnd.partials.get(client_id)
            return (0 if partial is None else partial.asm.frames_received), False
