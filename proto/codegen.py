"""Generate the Python gRPC code from proto/evospec/v1/*.proto (never hand-edit the generated files).

    python proto/codegen.py
Output: evospec/api/evospec/v1/{generate,speculation}_pb2{,_grpc}.py(+.pyi), importable as
`evospec.api.evospec.v1.generate_pb2`. (Not a top-level `proto` package: proto-plus, pulled in by Ray's
dependencies, already owns that name.) Imports between generated modules are rewritten to that package path.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTOS = sorted((ROOT / "evospec" / "v1").glob("*.proto"))
OUT = ROOT.parent / "evospec" / "api"


def main() -> int:
    from grpc_tools import protoc
    import grpc_tools
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    (OUT / "evospec" / "v1").mkdir(parents=True, exist_ok=True)
    for pkg in (OUT, OUT / "evospec", OUT / "evospec" / "v1"):
        (pkg / "__init__.py").touch()
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={OUT}", f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}", *map(str, PROTOS)]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for path in (OUT / "evospec" / "v1").glob("*_pb2*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^from evospec\.v1 import", "from evospec.api.evospec.v1 import", text, flags=re.M)
        # message classes carry this module path (pickling them, as Ray Serve does, imports it)
        fixed = re.sub(r"'evospec\.v1\.(\w+_pb2)'", r"'evospec.api.evospec.v1.\1'", fixed)
        path.write_text(fixed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
