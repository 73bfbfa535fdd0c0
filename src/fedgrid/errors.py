"""The exception hierarchy: one root, ``FedgridError``, with a subclass per kind of failure.

The gRPC servicer maps each subclass to one status code (``server/service.py``), so domain
code raises these and never touches ``grpc.StatusCode``. A refusal the SDK must tell apart
from others of its status code (a session replaced by another of the same identity, a run
that is over) carries a ``reason``: the servicer sends it as the call's trailing metadata
under ``REASON_METADATA_KEY``, so the client reads a fixed word, not the message text.
"""

from __future__ import annotations

__all__ = [
    "FedgridError",
    "ResourceLimitError",
    "ConfigError",
    "AdapterRankError",
    "VersionMismatchError",
    "InvalidUpdateError",
    "AuthenticationError",
    "PermissionDeniedError",
    "StaleTaskError",
    "DuplicateUpdateError",
    "PayloadTooLargeError",
    "RunFinishedError",
    "InterruptedRunError",
    "PKIError",
    "EnrollmentError",
    "CSRError",
    "EnrollmentNameError",
    "NonFiniteAggregateError",
    "SessionError",
    "SessionReplacedError",
    "REASON_METADATA_KEY",
    "SESSION_REPLACED",
    "RUN_FINISHED",
    "StorageError",
    "RoundLostError",
    "RecoveryError",
    "PrivacyBudgetError",
]

#: The trailing-metadata key of a refusal's ``FedgridError.reason``.
REASON_METADATA_KEY = "fedgrid-reason"
#: ``reason`` of ``SessionReplacedError``: another session of the same identity took this one's place.
SESSION_REPLACED = "session-replaced"
#: ``reason`` of ``RunFinishedError``: the run is over, there is nothing to join.
RUN_FINISHED = "run-finished"


class FedgridError(Exception):
    """Root of every error fedgrid raises on purpose."""

    #: A fixed word the servicer sends beside the status code ("": none; see the module docstring).
    reason = ""


class ConfigError(FedgridError, ValueError):
    """A configuration key or command-line flag is unknown, mistyped or out of range."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key '{key}': {problem}")
        self.key = key


class AdapterRankError(ConfigError):
    """A client's LoRA rank (``peft_rank``) that the run cannot take: outside the coordinator's
    bound, or mixed ranks under an aggregation that needs one shape. Names the key at fault."""


class InvalidUpdateError(FedgridError, ValueError):
    """A message or tensor is malformed: wrong shape, dtype, count, checksum, NaN/Inf, ..."""


class PayloadTooLargeError(InvalidUpdateError):
    """A stream or tensor is larger than it declared or than the server accepts."""


class AuthenticationError(FedgridError):
    """Unknown client id or wrong session token, or a revoked certificate."""


class SessionReplacedError(AuthenticationError):
    """A call of a session that a newer Join of the same identity replaced. Its process is still
    running, so two processes hold one identity (the same ``--partition`` or certificate): the
    SDK stops instead of joining again, which would replace the other one in turn."""

    reason = SESSION_REPLACED


class PermissionDeniedError(FedgridError):
    """An authenticated peer asked for what its identity may not do (act as another
    client, join under another name, present a certificate not made for a client)."""


class StaleTaskError(FedgridError):
    """The task or round named by a request is not open (closed, never assigned, or unknown)."""


class DuplicateUpdateError(FedgridError):
    """An update for this (run, round, client) was already accepted."""


class RunFinishedError(FedgridError):
    """The run is over; the client should leave."""

    reason = RUN_FINISHED


class BaseModelMismatchError(FedgridError):
    """A client's frozen base model (``--peft``: adapters travel, the base never does) is not the
    coordinator's: its adapters would be trained for another model. Names both hashes."""

    def __init__(self, client_hash: str, coordinator_hash: str) -> None:
        super().__init__(
            f"base model mismatch: the client's base is {client_hash or 'none (no --peft adapters)'}, the "
            f"coordinator's is {coordinator_hash or 'none (it fine-tunes no adapters)'}; give both the same "
            "--model hf:PATH folder and --peft"
        )
        self.client_hash, self.coordinator_hash = client_hash, coordinator_hash


class VersionMismatchError(FedgridError):
    """A client (or a region joining upstream) runs another fedgrid release than the coordinator:
    the wire, the codecs and the round rules are one release's, so it is refused at Join. Names both."""

    def __init__(self, client_version: str, coordinator_version: str) -> None:
        super().__init__(
            f"fedgrid version mismatch: the client runs fedgrid {client_version}, the coordinator "
            f"fedgrid {coordinator_version}; run the same release on both (the same image or package)"
        )
        self.client_version, self.coordinator_version = client_version, coordinator_version


class InterruptedRunError(FedgridError):
    """The coordinator is stopping; the open round is abandoned and will be redone."""


class ResourceLimitError(FedgridError):
    """A client asked for more than the coordinator allows at once (polls, transfers); retry later."""


class PKIError(FedgridError, ValueError):
    """A certificate directory or a certificate, key or CRL file is missing, malformed or
    inconsistent (key not matching its certificate, certificate not signed by the CA, expired).
    The message names the file; nothing was changed."""


class EnrollmentError(AuthenticationError):
    """An enrollment was refused: the token is unknown, used, expired or revoked, or the CSR is
    invalid or asks for a name it may not have. A subclass of ``AuthenticationError`` so that the
    servicer answers it with UNAUTHENTICATED like any other failed credential."""


class CSRError(EnrollmentError):
    """An enrollment's certificate request is malformed: not a PEM CSR, badly signed, an
    unsupported key, or a common name that is not a valid identity. The request is at fault,
    not the credential (the enrollment service answers INVALID_ARGUMENT); the token is not spent."""


class EnrollmentNameError(EnrollmentError):
    """An enrollment asked for a name it may not have: the token was issued for another name,
    or the name already has a valid certificate (the enrollment service answers
    PERMISSION_DENIED); the token is not spent."""


class NonFiniteAggregateError(FedgridError):
    """A round's aggregate holds NaN or Inf (finite updates can still overflow: two clients
    sending 3e38 sum to Inf): the round fails and the previous global model stays."""


class SessionError(FedgridError, RuntimeError):
    """An embedding session (``fedgrid.client.connect``) was used out of order: a result with
    no task to answer, tasks before it joined or after it closed."""


class StorageError(FedgridError):
    """The coordinator's disk refused a write (no space, an I/O error, a read-only or full
    quota): it stops, naming the path and the free space; the last good checkpoint stays and a
    restart after space is freed resumes from it. The servicer answers UNAVAILABLE, so clients
    wait and retry instead of leaving."""


class RoundLostError(FedgridError):
    """Every result of a round was lost (its clients or regions died, left or went silent):
    the round fails and runs again under the same number; raised to stop the run only once it
    was lost more times in a row than the engine retries."""


class PrivacyBudgetError(FedgridError):
    """The next round would spend more than the run's ``(dp_epsilon, dp_delta)`` budget: the run
    stops before it, its last committed round final (``fedgrid.server.privacy``)."""


class RecoveryError(FedgridError):
    """A state directory the coordinator will not guess from: every checkpoint unreadable, a
    checkpoint whose round disagrees with its file name or with the history journal, or a
    journal that records rounds no checkpoint holds. The message names the files; start a new
    run with ``--fresh`` (the old files are moved aside, not deleted)."""
