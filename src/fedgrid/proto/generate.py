"""Regenerates the committed protobuf and gRPC code from ``fedgrid.proto``.

``python -m fedgrid.proto.generate`` rewrites ``fedgrid_pb2.py``, ``fedgrid_pb2.pyi`` and
``fedgrid_pb2_grpc.py`` beside this file; ``--check`` regenerates into a temporary folder
and exits 1 when the committed files differ (stale code). Generation needs ``grpcio-tools``
1.81.x (the protobuf-6 toolchain), whose output imports on protobuf 6 and 7.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

__all__ = ["generate", "main"]

HERE = Path(__file__).resolve().parent
PROTO = "fedgrid.proto"
OUTPUTS = ("fedgrid_pb2.py", "fedgrid_pb2.pyi", "fedgrid_pb2_grpc.py")
TOOLS_SERIES = "1.81."


def generate(out_dir: Path) -> None:
    """Runs protoc on ``fedgrid.proto`` into ``out_dir``.

    Raises:
        RuntimeError: grpcio-tools is missing, of the wrong series, or protoc failed.
    """
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("grpcio-tools is not installed: pip install 'grpcio-tools==1.81.0'") from exc
    from importlib.metadata import version

    tools_version = version("grpcio-tools")
    if not tools_version.startswith(TOOLS_SERIES):
        raise RuntimeError(
            f"grpcio-tools {tools_version} found; the committed code is made with {TOOLS_SERIES}x "
            "so that it imports on protobuf 6 and 7"
        )
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{HERE}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(HERE / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    grpc_file = out_dir / "fedgrid_pb2_grpc.py"
    # protoc writes an absolute import; the module lives inside the fedgrid.proto package.
    text = grpc_file.read_text()
    text = text.replace("import fedgrid_pb2 as fedgrid__pb2", "from . import fedgrid_pb2 as fedgrid__pb2")
    grpc_file.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--check", action="store_true", help="fail when the committed code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(HERE)
        print(f"regenerated {', '.join(OUTPUTS)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            name
            for name in OUTPUTS
            if not (HERE / name).exists() or not filecmp.cmp(Path(tmp) / name, HERE / name, shallow=False)
        ]
    if stale:
        print(
            f"generated protobuf code is stale: {', '.join(stale)}; run `make proto` and commit",
            file=sys.stderr,
        )
        return 1
    print("generated protobuf code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
