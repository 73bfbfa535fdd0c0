"""Encoded bytes pinned for seeded tensors: a faster encoder must send exactly what the last one sent.

The inputs are dyadic (integers over 1024) with distinct magnitudes, so every sum a codec
takes (block absmax, chunk means, Hadamard rows, chunk energies) is exact in any order and
no top-k has ties: the bytes are the same on every CPU and thread count, and a change in
them is a change of the wire format. ``demo`` (a float DCT through BLAS) and the stochastic
codecs are left out for that reason; their round trips are tested in test_codecs.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from fedgrid.compression import get_codec
from fedgrid.compression.sparseloco import top_offsets

#: (shape, dtype) of each pinned input; sizes cut blocks, chunks and Hadamard rows short.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "matrix": ((96, 130), torch.float32),  # 12480: 3 full sparseloco chunks and a 192-element tail
    "vector": ((1000,), torch.float32),  # shorter than a chunk, not a multiple of a block
    "short": ((50,), torch.float32),  # shorter than a block
    "bf16": ((40, 33), torch.bfloat16),
}

#: SHA-256 (first 16 hex digits) of ``encode`` for each (spec, input), as sent before the
#: codecs were vectorised for speed (issue 40).
PINNED: dict[tuple[str, str], str] = {
    ("none", "matrix"): "e2f6a6adc6a645cc",
    ("none", "vector"): "9dd6cd7dd172095f",
    ("none", "short"): "cf0ca0bc84425eef",
    ("none", "bf16"): "ac98b143dc7ff24a",
    ("fp16", "matrix"): "2a95d3aa2de5e0a9",
    ("fp16", "vector"): "1ca6351afd4f4a22",
    ("fp16", "short"): "167ba5d81a2b58e6",
    ("fp16", "bf16"): "25d0ba9078a3f43b",
    ("bf16", "matrix"): "f7b13975916a0b1f",
    ("bf16", "vector"): "1fec7d55eaed6ffa",
    ("bf16", "short"): "01f9c0bb47c5cebe",
    ("bf16", "bf16"): "25d0ba9078a3f43b",
    ("int8", "matrix"): "ea9c5e5777ef6921",
    ("int8", "vector"): "2633917bcfaca65c",
    ("int8", "short"): "006932f894778d00",
    ("int8", "bf16"): "ed59a565f6ead78c",
    ("int8:64", "matrix"): "23d40f1c2377f8d3",
    ("int8:64", "vector"): "9155b557afc04c06",
    ("int8:64", "short"): "9d1662896ceba0ec",
    ("int8:64", "bf16"): "3d47e83b7b7593e1",
    ("int4", "matrix"): "e4877b90e8790602",
    ("int4", "vector"): "66b985a9cd3b8697",
    ("int4", "short"): "1a16149647229a05",
    ("int4", "bf16"): "2ec39633ece7960c",
    ("int4:64", "matrix"): "135c4ae5882bea2c",
    ("int4:64", "vector"): "63a50ea04772873d",
    ("int4:64", "short"): "ac4f48a5b73bbc8a",
    ("int4:64", "bf16"): "d002ccb84c1ee87a",
    ("fp4", "matrix"): "2711fe34e0371748",
    ("fp4", "vector"): "e940aa3261029a00",
    ("fp4", "short"): "4c53e6b81014e66e",
    ("fp4", "bf16"): "1fcdaae70fa0d337",
    ("fp4:64", "matrix"): "6948635f6dcb1c8d",
    ("fp4:64", "vector"): "206efc280550ab19",
    ("fp4:64", "short"): "4a9301f68f863b3e",
    ("fp4:64", "bf16"): "51c01727d0c6c92a",
    ("sign", "matrix"): "379b0fa04d0a451f",
    ("sign", "vector"): "ac1380785d21affb",
    ("sign", "short"): "c73c201e52833168",
    ("sign", "bf16"): "558936efbd415738",
    ("sign:64", "matrix"): "55bfc98adb457195",
    ("sign:64", "vector"): "627e7b5dc52f0d7b",
    ("sign:64", "short"): "c73c201e52833168",
    ("sign:64", "bf16"): "1bd80b38c87f99db",
    ("topk:0.01", "matrix"): "b8305b7565082f0a",
    ("topk:0.01", "vector"): "c448ee41140c1831",
    ("topk:0.01", "short"): "362e0bf40486affc",
    ("topk:0.01", "bf16"): "665d47ab3d3d1ad2",
    ("topk:0.1", "matrix"): "49a2809edadb9a01",
    ("topk:0.1", "vector"): "1043802a19d0c190",
    ("topk:0.1", "short"): "6e4cfb7ce10d1127",
    ("topk:0.1", "bf16"): "89b10c34b1e157dc",
    ("sparseloco", "matrix"): "b18fd8130cb0639f",
    ("sparseloco", "vector"): "60b03701edce075c",
    ("sparseloco", "short"): "9e31de49b84635b0",
    ("sparseloco", "bf16"): "a1b1625fc569d0f5",
    ("sparseloco:16", "matrix"): "03451870154020be",
    ("sparseloco:16", "vector"): "72bca324550ebb5c",
    ("sparseloco:16", "short"): "e67b17cb2c2336a1",
    ("sparseloco:16", "bf16"): "6bc6b086dd3e0404",
    ("sparseloco:64:scaled", "matrix"): "c817e28a563ce6ce",
    ("sparseloco:64:scaled", "vector"): "d3520c5390d5fe4b",
    ("sparseloco:64:scaled", "short"): "afa6fec59b8f3389",
    ("sparseloco:64:scaled", "bf16"): "fe5cdbe1e96311a4",
}


def pinned_input(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    n = torch.Size(shape).numel()
    gen = torch.Generator().manual_seed(40)
    magnitude = (torch.randperm(n, generator=gen) + 1).double()
    sign = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    return (magnitude * sign / 1024).to(dtype).reshape(shape)


def digest(spec: str, name: str) -> str:
    payload = get_codec(spec).encode(pinned_input(name))
    return hashlib.sha256(bytes(payload)).hexdigest()[:16]


@pytest.mark.parametrize(("spec", "name"), sorted(PINNED))
def test_encoded_bytes_are_pinned(spec: str, name: str) -> None:
    assert digest(spec, name) == PINNED[spec, name]


@pytest.mark.parametrize("kind", ["gaussian", "ties", "zeros"])
def test_top_offsets_takes_the_set_torch_topk_takes(kind: str) -> None:
    # sparseloco's and demo's prefiltered top-k: ties (rounded values, rows of zeros) go back
    # to torch.topk on the whole row, so even an ambiguous set is the one sent before.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 4096, generator=gen)
    if kind == "ties":
        x = x.round()
    elif kind == "zeros":
        x = torch.where(torch.rand(40, 4096, generator=gen) < 0.995, 0.0, x)
    magnitudes = x.abs()
    for k in (1, 16, 64, 128, 300):
        got = top_offsets(magnitudes, k).sort(dim=1).values
        want = torch.topk(magnitudes, k, dim=1, sorted=False).indices.sort(dim=1).values
        assert torch.equal(got, want), k
