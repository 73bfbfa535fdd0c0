"""The content of a checkpoint as data: ``encode_state`` turns the coordinator's state into a
JSON document and a safetensors blob, ``decode_state`` turns them back (the tags are in
``server/state.py``'s docstring). No pickle is written or read.

Neither direction copies the model: ``payload_chunks`` hands each tensor's own memory to the
writer, and ``content_of`` over a writable buffer (a checkpoint mapped copy-on-write) makes
tensors that view it. A coordinator at 3.5x the model (issue 40) has no room for the
checkpoint's bytes beside its state.
"""

from __future__ import annotations

import base64
import json
import math
from collections import OrderedDict
from typing import Any, Iterator, Mapping

import numpy as np
import safetensors.torch
import torch

from fedgrid.server.spill_files import SAFETENSORS_DTYPES

__all__ = ["encode_state", "decode_state", "payload_chunks", "payload_of", "content_of"]

#: safetensors' dtype names (its file format's, ``spill_files``' table), and back.
_DTYPE_NAMES = SAFETENSORS_DTYPES
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def encode_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-ready structure, tensors by path) of a checkpoint's content (see the module docstring).

    Raises:
        TypeError: a value of a type a checkpoint cannot hold (the message names its path).
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()  # storage addresses of the tensors kept

    def enc(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"float": repr(value)}
        if isinstance(value, torch.Tensor):
            key = path if path not in tensors else f"{path}#{len(tensors)}"
            t = value.detach().cpu().contiguous()
            if t.numel():  # safetensors refuses tensors sharing memory: copy a second view
                if t.untyped_storage().data_ptr() in storages:
                    t = t.clone()
                storages.add(t.untyped_storage().data_ptr())
            tensors[key] = t
            return {"tensor": key}
        if isinstance(value, np.generic):
            return {"numpy": value.dtype.str, "value": enc(value.item(), path)}
        if isinstance(value, bytes):
            return {"bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, tuple):
            return {"tuple": [enc(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            items = [[enc(k, f"{path}.<key>"), enc(v, f"{path}.{k}")] for k, v in value.items()]
            return {"odict" if isinstance(value, OrderedDict) else "dict": items}
        raise TypeError(
            f"checkpoint value at {path or '<root>'}: {type(value).__name__} cannot be stored (no pickles)"
        )

    return enc(obj, ""), tensors


def decode_state(doc: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of ``encode_state``.

    Raises:
        ValueError: an unknown tag or a missing tensor.
    """
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [decode_state(v, tensors) for v in doc]
    if not isinstance(doc, dict) or len(doc) not in (1, 2):
        raise ValueError(f"malformed checkpoint document near {str(doc)[:80]}")
    if "tensor" in doc:
        return tensors[doc["tensor"]]
    if "dict" in doc or "odict" in doc:
        pairs = doc["odict"] if "odict" in doc else doc["dict"]
        items = [(decode_state(k, tensors), decode_state(v, tensors)) for k, v in pairs]
        return OrderedDict(items) if "odict" in doc else dict(items)
    if "tuple" in doc:
        return tuple(decode_state(v, tensors) for v in doc["tuple"])
    if "float" in doc:
        return float(doc["float"])
    if "numpy" in doc:
        return np.dtype(doc["numpy"]).type(decode_state(doc["value"], tensors))
    if "bytes" in doc:
        return base64.b64decode(doc["bytes"])
    raise ValueError(f"unknown checkpoint tag {sorted(doc)}")


def payload_chunks(content: Mapping[str, Any]) -> Iterator[bytes | memoryview]:
    """A checkpoint's payload in pieces: the JSON document's length (8 bytes, little-endian), the
    document, then a safetensors blob (its header, then each tensor's bytes: views of the tensors
    themselves, valid until they change). The document and the header are padded with spaces to
    8 bytes, so tensors read back in place are aligned.

    Raises:
        TypeError: a value a checkpoint cannot store, or a tensor of a dtype safetensors has no
            name for (nothing yielded).
    """
    doc, tensors = encode_state(dict(content))
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    text += b" " * (-len(text) % 8)
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"checkpoint tensor {name}: dtype {t.dtype} cannot be stored")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    yield len(text).to_bytes(8, "little") + text
    yield len(head).to_bytes(8, "little") + head
    for t in tensors.values():
        if t.numel():
            yield t.reshape(-1).view(torch.uint8).numpy().data


def payload_of(content: Mapping[str, Any]) -> bytes:
    """``payload_chunks`` joined into one ``bytes`` (a copy: for small states and tests)."""
    return b"".join(payload_chunks(content))


def content_of(payload: bytes | bytearray | memoryview | Any) -> Any:
    """Inverse of ``payload_of``. Over a writable buffer (``bytearray``, a copy-on-write ``mmap``)
    the tensors view it and keep it alive; over ``bytes`` they are copies.

    Raises:
        ValueError: a payload shorter than its document, or a malformed one.
    """
    view = memoryview(payload).cast("B")
    n = int.from_bytes(view[:8], "little")
    if len(view) < 8 or n > len(view) - 8:
        raise ValueError("payload shorter than its JSON document")
    doc = json.loads(bytes(view[8 : 8 + n]))
    return decode_state(doc, _tensors_of(view[8 + n :]))


def _tensors_of(blob: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors blob, viewing ``blob`` where it is writable and aligned."""
    if blob.readonly:
        return safetensors.torch.load(bytes(blob))
    if len(blob) < 8:
        raise ValueError("safetensors blob shorter than its header")
    h = int.from_bytes(blob[:8], "little")
    if h > len(blob) - 8:
        raise ValueError("safetensors header longer than the blob")
    header = json.loads(bytes(blob[8 : 8 + h]))
    start, end_of_data = 8 + h, len(blob) - 8 - h
    tensors: dict[str, torch.Tensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name}: unknown dtype {meta['dtype']!r}")
        begin, stop = (int(x) for x in meta["data_offsets"])
        shape = [int(d) for d in meta["shape"]]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= stop <= end_of_data or stop - begin != math.prod(shape) * itemsize:
            raise ValueError(
                f"tensor {name}: offsets {meta['data_offsets']} do not fit its shape or the blob"
            )
        if begin == stop:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(blob, dtype=torch.uint8, count=stop - begin, offset=start + begin)
        if raw.data_ptr() % itemsize:
            raw = raw.clone()  # an older checkpoint's unpadded document: copy to align
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors
