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
The CLI (orchestration/cli.py) is the top floor, above bench: it imports bench's and loadtest's `main` when a
command runs them (`own_main`), and nothing imports it. Inside the core, packages import in one order too
(`CORE_ORDER`, bottom first): kernels, errors, cache, tokenizer, datasets -> config, modelstore, tiny_pair -> tree,
sampling -> verify -> vocab, model -> adapt -> engine -> loading, testing; a module may import its own package and
those of lower rows. No import circles anywhere (function-level imports count; `if TYPE_CHECKING:` does not).
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


@pytest.mark.process
def test_generated_grpc_code_is_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "codegen.py"), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def imported_modules(path: Path, module: str | None = None) -> set[str]:
    """Every module `path` imports, anywhere in it (function-level imports too), except under `if TYPE_CHECKING:`;
    relative imports are resolved against `module` (the file's own import name) when given."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
    package = (module if path.name == "__init__.py" else module.rpartition(".")[0]) if module else ""
    modules = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level and package:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            elif node.level == 0 and node.module:
                name = node.module
            else:
                continue
            modules.add(name)
            modules |= {f"{name}.{a.name}" for a in node.names}  # `from pkg import module`
    return modules


def project_modules() -> dict[str, Path]:
    """Every module of the server distribution by its import name (generated code excluded)."""
    found = {}
    for name, folder in PACKAGE_DIR.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or "tiny_pair/weights" in str(path):
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join([name, *parts])] = path
    return found


MODULES = project_modules()
IMPORTS = {module: {m for m in imported_modules(path, module) if m in MODULES and m != module}
           for module, path in MODULES.items()}

# the floors above the core, bottom to top (the module docstring's rule); the CLI is the top floor
CLI = "evospec.orchestration.cli"
LAYERS = ("evospec.services", "evospec.orchestration", "evospec.loadtest", "evospec.bench", CLI)
# the core's own order, bottom first: a module may import its own unit and the units of lower rows
CORE_ORDER = (
    ("evospec.kernels", "evospec.errors", "evospec.cache", "evospec.tokenizer", "evospec.datasets"),
    ("evospec.config", "evospec.modelstore", "evospec.tiny_pair"),
    ("evospec.tree", "evospec.sampling"),
    ("evospec.verify",),
    ("evospec.vocab", "evospec.model"),
    ("evospec.adapt",),
    ("evospec.engine",),
    ("evospec.loading", "evospec.testing"),
)


def unit_of(module: str, units) -> str | None:
    """The longest of `units` that `module` is or lies under."""
    matches = [u for u in units if module == u or module.startswith(u + ".")]
    return max(matches, key=len, default=None)


def floor(module: str) -> int:
    """0 for the core, then the index in LAYERS + 1."""
    layer = unit_of(module, LAYERS)
    return 0 if layer is None else LAYERS.index(layer) + 1


def test_imports_run_one_way():
    """No module imports one of a higher floor (the CLI may import everything; nothing imports the CLI)."""
    bad = [f"{m} imports {d}" for m, deps in IMPORTS.items() for d in deps if floor(d) > floor(m)]
    assert not bad, "\n".join(sorted(bad))


def test_the_core_imports_in_its_own_order():
    rank = {unit: row for row, units in enumerate(CORE_ORDER) for unit in units}
    core = [m for m in IMPORTS if floor(m) == 0 and m != "evospec"]  # the namespace's empty __init__ aside
    assert all(unit_of(m, rank) for m in core), [m for m in core if not unit_of(m, rank)]  # every module placed
    bad = []
    for module in core:
        own = unit_of(module, rank)
        for dep in IMPORTS[module]:
            other = unit_of(dep, rank)
            if other is not None and other != own and rank[other] >= rank[own]:
                bad.append(f"{module} ({own}, row {rank[own]}) imports {dep} ({other}, row {rank[other]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    """No circle of imports between the project's modules (function-level imports count; TYPE_CHECKING does not).
    Tarjan's strongly connected components: any component of more than one module is a circle."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for dep in IMPORTS[module]:
            if dep not in index:
                visit(dep)
                low[module] = min(low[module], low[dep])
            elif dep in on_stack:
                low[module] = min(low[module], index[dep])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))
    for module in sorted(IMPORTS):
        if module not in index:
            visit(module)
    assert not circles, circles


@pytest.mark.parametrize("layer_folder, forbidden", [("evospec", ("ray", "grpc", "grpc_health", "evospec_client")),
                                                     ("kernels", ("ray", "grpc"))])
def test_the_core_needs_no_ray_or_grpc(layer_folder, forbidden):
    bad = [f"{path.relative_to(ROOT)} imports {m}" for path in (ROOT / layer_folder).rglob("*.py")
           for m in imported_modules(path) if m.split(".")[0] in forbidden]
    assert not bad, "\n".join(bad)


def test_the_cli_dispatches_every_command_with_its_own_parser():
    from evospec.orchestration.cli import BENCH_SUITES, build_parser, own_main
    commands = build_parser()._subparsers._group_actions[0].choices
    for suite in BENCH_SUITES:
        assert callable(own_main(["bench", suite])), suite
    own = [c for c in commands if c != "bench" and own_main([c]) is not None]
    assert sorted(own) == sorted(["loadtest", "loadtest-sweep", "loadtest-compare", "train-tiny", "chaos", "fuzz",
                                  "soak"])
    assert own_main(["serve"]) is None and own_main([]) is None


@pytest.mark.process
def test_client_sdk_imports_only_grpc_and_protobuf():
    code = ("import sys, evospec_client; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'evospec', 'transformers')); "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
