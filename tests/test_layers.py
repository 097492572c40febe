"""The packages' layering, read from the code's own imports: no module imports a package
above its own, and no two modules import each other, directly or around a loop; and the
engine side stays free of torch and transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# From the bottom. A package may import its own modules and any package below it.
LAYERS = [
    "messages",
    "zmqworker.cdiv",
    "zmqworker.dot_precision",
    "zmqworker.pdl",
    "zmqworker.triton_rms",
    "zmqworker.triton_device",
    "zmqworker.transport",
    "zmqworker.attention",
    "zmqworker.distributed",
    "zmqworker.models",
    "zmqworker.model_runner",
    "zmqworker.kv_transfer",
    "zmqworker.worker",
    "zmqworker.runtime",
    "zmqworker.executor",
    "zmqworker.engine",
    "zmqworker.frontend",
    "zmqworker.serve",
    "zmqworker.cli",
    "zmqworker.__main__",
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The index of the room module lives in (None: the package roots themselves)."""
    best = None
    for index, room in enumerate(LAYERS):
        if module == room or module.startswith(room + "."):
            best = index
    return best


def imports_of(path: Path, module: str) -> set[str]:
    """Every module path imports (at any depth: TYPE_CHECKING and lazy imports count)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in ("zmqworker", "messages")}


def project_modules() -> dict[str, Path]:
    files = [*ROOT.joinpath("zmqworker").rglob("*.py"), *ROOT.joinpath("messages").rglob("*.py")]
    return {module_name(p): p for p in files}


def test_every_package_has_a_layer() -> None:
    rooms = {".".join(name.split(".")[:2]) for name in project_modules() if name.count(".") >= 1}
    missing = [r for r in sorted(rooms) if r.startswith("zmqworker") and layer_of(r) is None]
    assert not missing, f"packages without a layer in {__file__}: {missing}"


def test_no_module_imports_a_package_above_its_own() -> None:
    modules = project_modules()
    upward = []
    for name, path in modules.items():
        mine = layer_of(name)
        if mine is None:
            continue
        for imported in imports_of(path, name):
            theirs = layer_of(imported)
            if theirs is not None and theirs > mine:
                upward.append(f"{name} imports {imported}")
    assert not upward, "imports of a package above the importer's:\n" + "\n".join(upward)


def test_no_import_cycle_among_files() -> None:
    modules = project_modules()
    graph = {
        name: {m for m in imports_of(path, name) if m in modules and m != name}
        for name, path in modules.items()
    }
    # A package's __init__ re-exporting its modules is not a cycle with them.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_file_over_400_lines() -> None:
    """Files split along their seams stay small enough to read in one sitting."""
    long = {
        str(path.relative_to(ROOT)): n
        for package in ("zmqworker", "messages")
        for path in sorted((ROOT / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, f"files over 400 lines: {long}"


def test_the_engine_side_imports_neither_torch_nor_transformers() -> None:
    """The messages and the engine up to spawning its workers stay light: torch and
    transformers cost seconds of start-up, and the workers import them in parallel."""
    code = (
        "import sys, messages, zmqworker.frontend.llm, zmqworker.cli.generate;"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_a_worker_process_imports_torch_only_to_build_a_torch_worker() -> None:
    """A worker process binds its sockets and says Hello without torch or transformers
    (they load with the torch worker class): a stand-in worker (the tests' echo worker)
    starts in a fraction of a second."""
    code = (
        "import sys, zmqworker.runtime.main, zmqworker.runtime.worker_process, "
        "bench.echo_worker;"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.stdout.strip() == "[]", out.stdout
