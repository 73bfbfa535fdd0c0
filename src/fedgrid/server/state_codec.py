"""The content of a checkpoint as data: ``encode_state`` turns the coordinator's state into a
JSON document and a safetensors blob, ``decode_state`` turns them back (the tags are in
``server/state.py``'s docstring). No pickle is written or read.
"""

from __future__ import annotations

import base64
import json
import math
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np
import safetensors.torch
import torch

__all__ = ["encode_state", "decode_state", "payload_of", "content_of"]


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


def payload_of(content: Mapping[str, Any]) -> bytes:
    """A checkpoint's payload: the JSON document's length (8 bytes, little-endian), the document, the tensors."""
    doc, tensors = encode_state(dict(content))
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return len(text).to_bytes(8, "little") + text + safetensors.torch.save(tensors)


def content_of(payload: bytes) -> Any:
    """Inverse of ``payload_of``.

    Raises:
        ValueError: a payload shorter than its document, or a malformed one.
    """
    n = int.from_bytes(payload[:8], "little")
    if len(payload) < 8 or n > len(payload) - 8:
        raise ValueError("payload shorter than its JSON document")
    doc = json.loads(payload[8 : 8 + n])
    tensors = safetensors.torch.load(payload[8 + n :])
    return decode_state(doc, tensors)
