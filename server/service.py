"""The thin gRPC servicer: decode, call ``GrpcFleet``, map domain errors to status codes."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, NoReturn

import grpc

from fedgrid.errors import (
    AuthenticationError,
    DuplicateUpdateError,
    FedgridError,
    InvalidUpdateError,
    RunFinishedError,
    StaleTaskError,
)
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto import serde
from fedgrid.server.grpc_fleet import GrpcFleet

__all__ = ["CoordinatorServicer", "STATUS_OF", "add_to_server", "SERVICE"]

SERVICE = "fedgrid.v1.Coordinator"

log = logging.getLogger(__name__)

#: One place maps each domain error to its status code (most specific first).
STATUS_OF: tuple[tuple[type[FedgridError], grpc.StatusCode], ...] = (
    (InvalidUpdateError, grpc.StatusCode.INVALID_ARGUMENT),
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (DuplicateUpdateError, grpc.StatusCode.ALREADY_EXISTS),
    (StaleTaskError, grpc.StatusCode.FAILED_PRECONDITION),
    (RunFinishedError, grpc.StatusCode.FAILED_PRECONDITION),
)


def _abort(context: grpc.ServicerContext, exc: FedgridError) -> NoReturn:
    for kind, code in STATUS_OF:
        if isinstance(exc, kind):
            log.info("rejected request: %s: %s", code.name, exc)
            context.abort(code, str(exc))
    context.abort(grpc.StatusCode.INTERNAL, str(exc))
    raise AssertionError("unreachable: context.abort raises")


@contextlib.contextmanager
def _mapped(context: grpc.ServicerContext) -> Iterator[None]:
    try:
        yield
    except FedgridError as exc:
        _abort(context, exc)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Implements ``fedgrid.v1.Coordinator`` over a ``GrpcFleet``."""

    def __init__(self, fleet: GrpcFleet) -> None:
        self.fleet = fleet

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        with _mapped(context):
            info, token = self.fleet.join(serde.client_info_from_join("", request))
            return pb.JoinReply(
                client_id=info.client_id,
                session_token=token,
                run_id=self.fleet.run_id,
                heartbeat_interval_s=self.fleet.heartbeat_interval_s,
                chunk_size=self.fleet.chunk_size,
            )

    def PollTask(self, request: pb.PollRequest, context: grpc.ServicerContext) -> pb.PollReply:
        with _mapped(context):
            wait = request.wait_s
            remaining = context.time_remaining()
            if remaining is not None:  # answer before the caller's deadline
                wait = min(wait, max(0.0, remaining - 1.0))
            result = self.fleet.poll(request.client_id, request.session_token, wait)
            if result.finished:
                return pb.PollReply(finished=True)
            if result.ins is None:
                return pb.PollReply(retry_after_s=result.retry_after_s)
            return pb.PollReply(
                task=pb.Task(
                    task_id=result.task_id,
                    round=result.server_round,
                    kind=pb.EVALUATE if result.evaluate else pb.FIT,
                    config=serde.config_to_pb(result.ins.config),
                    deadline_s=result.deadline_s,
                )
            )

    def DownloadModel(self, request: pb.DownloadRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        with _mapped(context):
            have = request.have_version if request.HasField("have_version") else None
            yield from self.fleet.download(request.client_id, request.session_token, request.task_id, have)

    def UploadUpdate(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.UploadReply:
        with _mapped(context):
            received = self.fleet.upload(request_iterator)
            return pb.UploadReply(accepted=True, bytes_received=received)

    def UploadStatus(self, request: pb.UploadStatusRequest, context: grpc.ServicerContext) -> pb.UploadStatusReply:
        with _mapped(context):
            received, accepted = self.fleet.upload_status(request.client_id, request.session_token, request.task_id)
            return pb.UploadStatusReply(chunks_received=received, accepted=accepted)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        with _mapped(context):
            return pb.HeartbeatReply(interval_s=self.fleet.heartbeat(request.client_id, request.session_token))

    def ReportFailure(self, request: pb.ReportFailureRequest, context: grpc.ServicerContext) -> pb.ReportFailureReply:
        with _mapped(context):
            self.fleet.report_failure(request.client_id, request.session_token, request.task_id, request.reason)
            return pb.ReportFailureReply()

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        with _mapped(context):
            self.fleet.leave(request.client_id, request.session_token, request.reason)
            return pb.LeaveReply()


def add_to_server(servicer: CoordinatorServicer, server: grpc.Server) -> None:
    """Registers the service. The two chunk streams move encoded ``Chunk`` messages as bytes
    (identity serializers), so model payloads are copied once on each side instead of
    passing through protobuf objects; on the wire they are ordinary ``Chunk`` messages."""
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            servicer.Join, request_deserializer=pb.JoinRequest.FromString, response_serializer=pb.JoinReply.SerializeToString
        ),
        "PollTask": grpc.unary_unary_rpc_method_handler(
            servicer.PollTask, request_deserializer=pb.PollRequest.FromString, response_serializer=pb.PollReply.SerializeToString
        ),
        "DownloadModel": grpc.unary_stream_rpc_method_handler(
            servicer.DownloadModel, request_deserializer=pb.DownloadRequest.FromString, response_serializer=None
        ),
        "UploadUpdate": grpc.stream_unary_rpc_method_handler(
            servicer.UploadUpdate, request_deserializer=None, response_serializer=pb.UploadReply.SerializeToString
        ),
        "UploadStatus": grpc.unary_unary_rpc_method_handler(
            servicer.UploadStatus,
            request_deserializer=pb.UploadStatusRequest.FromString,
            response_serializer=pb.UploadStatusReply.SerializeToString,
        ),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            servicer.Heartbeat,
            request_deserializer=pb.HeartbeatRequest.FromString,
            response_serializer=pb.HeartbeatReply.SerializeToString,
        ),
        "ReportFailure": grpc.unary_unary_rpc_method_handler(
            servicer.ReportFailure,
            request_deserializer=pb.ReportFailureRequest.FromString,
            response_serializer=pb.ReportFailureReply.SerializeToString,
        ),
        "Leave": grpc.unary_unary_rpc_method_handler(
            servicer.Leave, request_deserializer=pb.LeaveRequest.FromString, response_serializer=pb.LeaveReply.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
