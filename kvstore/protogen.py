"""Regenerate kvstore/v1/*_pb2*.py from protos/kvstore/v1/*.proto.

    python -m kvstore.protogen          # write the generated files
    python -m kvstore.protogen --check  # exit 1 if the committed files are stale

The generated code is committed so that a plain `pip install` needs no
grpcio-tools; tests/unit/test_protogen.py runs --check so a proto edit without
regeneration fails CI.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_PACKAGE = Path("kvstore") / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every proto; return the generated files, relative to out_root."""
    from grpc_tools import protoc  # dev-only dependency

    protos = sorted(
        str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "kvstore" / "v1").glob("*.proto")
    )
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_DIR}")
    include = str(Path(protoc.__file__).parent / "_proto")
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            *protos,
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted(p.relative_to(out_root) for p in (out_root / OUT_PACKAGE).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if committed output is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        stale = []
        for rel in files:
            committed = ROOT / rel
            if not committed.exists() or not filecmp.cmp(Path(tmp) / rel, committed, shallow=False):
                stale.append(rel)
        committed_set = {p.relative_to(ROOT) for p in (ROOT / OUT_PACKAGE).glob("*_pb2*.py*")}
        extra = sorted(committed_set - set(files))
        if args.check:
            if stale or extra:
                print(
                    "stale generated files: " + ", ".join(map(str, stale + extra)), file=sys.stderr
                )
                print("run: python -m kvstore.protogen", file=sys.stderr)
                return 1
            print(f"{len(files)} generated files are up to date")
            return 0
        for rel in files:
            (ROOT / rel).write_bytes((Path(tmp) / rel).read_bytes())
        for rel in extra:
            (ROOT / rel).unlink()
        print(f"wrote {len(files)} files under {ROOT / OUT_PACKAGE}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
