from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT8_E4M3FN: _ClassVar[DType]
    FLOAT8_E5M2: _ClassVar[DType]
    INT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    UINT16: _ClassVar[DType]
    UINT32: _ClassVar[DType]
    UINT64: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    COMPLEX64: _ClassVar[DType]
    COMPLEX128: _ClassVar[DType]
    FLOAT8_E4M3FNUZ: _ClassVar[DType]
    FLOAT8_E5M2FNUZ: _ClassVar[DType]

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_UNSPECIFIED: _ClassVar[TaskKind]
    FIT: _ClassVar[TaskKind]
    EVALUATE: _ClassVar[TaskKind]
    MESSAGE: _ClassVar[TaskKind]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT8_E4M3FN: DType
FLOAT8_E5M2: DType
INT8: DType
INT16: DType
INT32: DType
INT64: DType
UINT8: DType
UINT16: DType
UINT32: DType
UINT64: DType
BOOL: DType
COMPLEX64: DType
COMPLEX128: DType
FLOAT8_E4M3FNUZ: DType
FLOAT8_E5M2FNUZ: DType
TASK_KIND_UNSPECIFIED: TaskKind
FIT: TaskKind
EVALUATE: TaskKind
MESSAGE: TaskKind

class Scalar(_message.Message):
    __slots__ = ("f", "i", "s", "b")
    F_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    S_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    f: float
    i: int
    s: str
    b: bool
    def __init__(self, f: _Optional[float] = ..., i: _Optional[int] = ..., s: _Optional[str] = ..., b: _Optional[bool] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("device", "num_accelerators", "memory_bytes", "codecs")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCELERATORS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    device: str
    num_accelerators: int
    memory_bytes: int
    codecs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device: _Optional[str] = ..., num_accelerators: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., codecs: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("name", "region", "capabilities", "num_examples", "base_hash", "lora_rank", "fedgrid_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    BASE_HASH_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    FEDGRID_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    region: str
    capabilities: Capabilities
    num_examples: int
    base_hash: str
    lora_rank: int
    fedgrid_version: str
    def __init__(self, name: _Optional[str] = ..., region: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., num_examples: _Optional[int] = ..., base_hash: _Optional[str] = ..., lora_rank: _Optional[int] = ..., fedgrid_version: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("client_id", "session_token", "run_id", "heartbeat_interval_s", "chunk_size", "base_hash")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BASE_HASH_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    session_token: str
    run_id: str
    heartbeat_interval_s: float
    chunk_size: int
    base_hash: str
    def __init__(self, client_id: _Optional[str] = ..., session_token: _Optional[str] = ..., run_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., chunk_size: _Optional[int] = ..., base_hash: _Optional[str] = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("client_id", "wait_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    wait_s: float
    def __init__(self, client_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "round", "kind", "config", "deadline_s", "phase", "peers")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Scalar
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Scalar, _Mapping]] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    kind: TaskKind
    config: _containers.MessageMap[str, Scalar]
    deadline_s: float
    phase: str
    peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., config: _Optional[_Mapping[str, Scalar]] = ..., deadline_s: _Optional[float] = ..., phase: _Optional[str] = ..., peers: _Optional[_Iterable[str]] = ...) -> None: ...

class PollReply(_message.Message):
    __slots__ = ("task", "retry_after_s", "finished")
    TASK_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    task: Task
    retry_after_s: float
    finished: bool
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ..., retry_after_s: _Optional[float] = ..., finished: _Optional[bool] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("client_id", "task_id", "have_version")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    task_id: str
    have_version: int
    def __init__(self, client_id: _Optional[str] = ..., task_id: _Optional[str] = ..., have_version: _Optional[int] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "nbytes", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    nbytes: int
    checksum: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class StreamHeader(_message.Message):
    __slots__ = ("run_id", "task_id", "round", "num_tensors", "total_bytes", "client_id", "num_examples", "metrics", "resume_from_chunk", "delta", "version", "base_version")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_CHUNK_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task_id: str
    round: int
    num_tensors: int
    total_bytes: int
    client_id: str
    num_examples: int
    metrics: _containers.ScalarMap[str, float]
    resume_from_chunk: int
    delta: bool
    version: int
    base_version: int
    def __init__(self, run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., round: _Optional[int] = ..., num_tensors: _Optional[int] = ..., total_bytes: _Optional[int] = ..., client_id: _Optional[str] = ..., num_examples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., resume_from_chunk: _Optional[int] = ..., delta: _Optional[bool] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("header", "tensor", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StreamHeader
    tensor: TensorMeta
    data: bytes
    def __init__(self, header: _Optional[_Union[StreamHeader, _Mapping]] = ..., tensor: _Optional[_Union[TensorMeta, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("accepted", "bytes_received")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    bytes_received: int
    def __init__(self, accepted: _Optional[bool] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class UploadStatusRequest(_message.Message):
    __slots__ = ("client_id", "task_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    task_id: str
    def __init__(self, client_id: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class UploadStatusReply(_message.Message):
    __slots__ = ("chunks_received", "accepted")
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    chunks_received: int
    accepted: bool
    def __init__(self, chunks_received: _Optional[int] = ..., accepted: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("client_id", "progress")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    progress: TaskProgress
    def __init__(self, client_id: _Optional[str] = ..., progress: _Optional[_Union[TaskProgress, _Mapping]] = ...) -> None: ...

class TaskProgress(_message.Message):
    __slots__ = ("round", "steps_done", "steps_total", "examples_per_s", "tokens_per_s", "eta_s")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    round: int
    steps_done: int
    steps_total: int
    examples_per_s: float
    tokens_per_s: float
    eta_s: float
    def __init__(self, round: _Optional[int] = ..., steps_done: _Optional[int] = ..., steps_total: _Optional[int] = ..., examples_per_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., eta_s: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("client_id", "task_id", "reason")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    task_id: str
    reason: str
    def __init__(self, client_id: _Optional[str] = ..., task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportFailureReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("client_id", "reason")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    reason: str
    def __init__(self, client_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("peer", "payload")
    PEER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    peer: str
    payload: bytes
    def __init__(self, peer: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class SendMessagesRequest(_message.Message):
    __slots__ = ("client_id", "task_id", "messages")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    task_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Envelope]
    def __init__(self, client_id: _Optional[str] = ..., task_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Envelope, _Mapping]]] = ...) -> None: ...

class SendMessagesReply(_message.Message):
    __slots__ = ("bytes_accepted",)
    BYTES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    bytes_accepted: int
    def __init__(self, bytes_accepted: _Optional[int] = ...) -> None: ...

class ReceiveMessagesRequest(_message.Message):
    __slots__ = ("client_id", "task_id", "start", "wait_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    task_id: str
    start: int
    wait_s: float
    def __init__(self, client_id: _Optional[str] = ..., task_id: _Optional[str] = ..., start: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ReceiveMessagesReply(_message.Message):
    __slots__ = ("ready", "messages", "total", "retry_after_s")
    READY_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    messages: _containers.RepeatedCompositeFieldContainer[Envelope]
    total: int
    retry_after_s: float
    def __init__(self, ready: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[Envelope, _Mapping]]] = ..., total: _Optional[int] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class EnrollRequest(_message.Message):
    __slots__ = ("token", "csr_pem")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    token: str
    csr_pem: bytes
    def __init__(self, token: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class EnrollReply(_message.Message):
    __slots__ = ("certificate_pem", "identity")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    identity: str
    def __init__(self, certificate_pem: _Optional[bytes] = ..., identity: _Optional[str] = ...) -> None: ...
