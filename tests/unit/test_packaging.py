"""Packaging and layering: every package folder is installed under the evospec namespace, the committed gRPC code
matches the protos, imports run one way, and the client SDK is light.

The layering rule (imports point down only; test_imports_run_one_way):

    bench -> loadtest -> orchestration -> services -> core (evospec, kernels)

- core: the engine, models, vocabularies and shared data helpers (e.g. the prompt datasets, evospec.datasets).
- services: the Draft and Target servers and deployments.
- orchestration: the deployment (config, app, the local runner in orchestration/local.py) and the ops tools that
  drive it (chaos, fuzz, soak).
- loadtest: the load generator; its sweep starts the service through orchestration's local runner.
- bench: the benchmark suites; they start the service through orchestration and load it with loadtest's generator.
Code that a lower layer needs from a higher one moves down (soak's prompts come from evospec.datasets, not loadtest).
The one upward reach is the `evospec` CLI (orchestration/cli.py): it runs loadtest's and bench's `main` by module
name at run time (passthrough_module), never through an import statement.
"""
import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIR = PYPROJECT["tool"]["setuptools"]["package-dir"]  # import name -> folder


def package_folders() -> dict[str, Path]:
    """Every folder with an __init__.py under the mapped roots, by its import name."""
    found = {}
    for name, folder in PACKAGE_DIR.items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found[".".join([name, *rel.parts])] = init.parent
    return found


def test_every_package_folder_is_installed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert set(package_folders()) == listed


def test_generated_grpc_code_is_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "codegen.py"), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


# the layers above the core, bottom to top (the module docstring's rule)
LAYERS = ("evospec.services", "evospec.orchestration", "evospec.loadtest", "evospec.bench")


def above(layer: str) -> tuple[str, ...]:
    return LAYERS[LAYERS.index(layer) + 1:]


# folder -> import prefixes its files must not use (generated code excluded)
FORBIDDEN = {
    "evospec": ("ray", "grpc", "grpc_health", "evospec_client", *LAYERS),
    "kernels": ("ray", "grpc", *LAYERS),
    "services": above("evospec.services"),
    "orchestration": above("evospec.orchestration"),
    "loadtest": above("evospec.loadtest"),
}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_run_one_way(folder):
    bad = []
    for path in (ROOT / folder).rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for module in imported_modules(path):
            if any(module == p or module.startswith(p + ".") for p in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_client_sdk_imports_only_grpc_and_protobuf():
    code = ("import sys, evospec_client; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'evospec', 'transformers')); "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
