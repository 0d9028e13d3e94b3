"""The dependency direction of DESIGN.md, checked by walking every module's imports."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGE = ROOT / "geserve"
FRONT_END_LIBRARIES = ("fastapi", "starlette", "uvicorn", "grpc")
# geserve.listeners is the server's listening side (uvicorn and gRPC servers), shared by every process layout;
# geserve.multiprocess wires the same layers into several processes.
FRONT_ENDS = (
    "geserve.http",
    "geserve.grpc",
    "geserve.metrics",
    "geserve.server",
    "geserve.hosts",
    "geserve.cli",
    "geserve.__main__",
    "geserve.listeners",
    "geserve.multiprocess",
)
FRONT_END_PACKAGES = ("geserve.http", "geserve.grpc", "geserve.metrics")
BELOW_CORE = ("geserve.batching", "geserve.workers", "geserve.backends")
# Multi-process mode: a protocol process serves HTTP and gRPC over the engine's channel, never running a model
# itself, so these modules see the core only through its API (and the log settings every process applies).
PROTOCOL_SIDE = (
    "geserve.multiprocess.remote",
    "geserve.multiprocess.protocol",
    "geserve.multiprocess.framing",
    "geserve.multiprocess.calls",
    "geserve.multiprocess.connection_count",
)
# A protocol process reads and writes client shared-memory regions itself, through a mirror of the engine's
# registry that shares the engine's checks (core.shared_memory).
PROTOCOL_SIDE_CORE_ALLOWED = ("geserve.core.api", "geserve.core.log_control", "geserve.core.shared_memory")
# The supervisor stays small: it binds ports, forks the engine and the protocol processes, forwards signals and
# restarts what dies; a bug in it takes the whole server down, and none of the server's code runs in it. What the
# forked processes run (and so what the supervisor imports before it forks) it reaches only through
# geserve.multiprocess.child.
SUPERVISOR_FORBIDDEN = (
    "geserve.core",
    "geserve.server",
    "geserve.hosts",
    "geserve.http",
    "geserve.grpc",
    "geserve.metrics",
    "geserve.listeners",
    "geserve.batching",
    "geserve.backends",
    "geserve.cli",
    "geserve.multiprocess.engine",
    "geserve.multiprocess.endpoint",
    "geserve.multiprocess.protocol",
    "geserve.multiprocess.remote",
)
# Layer -> geserve packages it must not import. The front-ends see only core's API (InferenceAPI); core gets
# its instance pools from a factory the server injects, so it sees batching but no worker or backend;
# nothing but the server and the CLI imports a front-end.
FORBIDDEN = {
    "geserve.http": ("geserve.grpc", "geserve.metrics", *BELOW_CORE, "geserve.server", "geserve.cli"),
    "geserve.grpc": ("geserve.http", "geserve.metrics", *BELOW_CORE, "geserve.server", "geserve.cli"),
    "geserve.metrics": ("geserve.http", "geserve.grpc", *BELOW_CORE, "geserve.server", "geserve.cli"),
    "geserve.core": (*FRONT_END_PACKAGES, "geserve.workers", "geserve.backends", "geserve.server", "geserve.cli"),
    "geserve.batching": ("geserve.core", *FRONT_END_PACKAGES, "geserve.backends", "geserve.server", "geserve.cli"),
    "geserve.workers": ("geserve.core", "geserve.batching", *FRONT_END_PACKAGES, "geserve.server", "geserve.cli"),
    "geserve.backends": (
        "geserve.core",
        "geserve.batching",
        "geserve.workers",
        *FRONT_END_PACKAGES,
        "geserve.server",
        "geserve.cli",
    ),
    "geserve.offline": (*FRONT_END_PACKAGES, "geserve.server", "geserve.cli"),
    # ATC is what a worker pool calls to compile a `ge` model and what the offline tools call: below both.
    "geserve.atc": (
        "geserve.core",
        *BELOW_CORE,
        *FRONT_END_PACKAGES,
        "geserve.offline",
        "geserve.multiprocess",
        "geserve.server",
        "geserve.cli",
    ),
    # The processes the supervisor forks are started from the settings the entry point built, not by it.
    "geserve.multiprocess": ("geserve.cli", "geserve.__main__"),
    "geserve.repository": ("geserve.core", *BELOW_CORE, *FRONT_END_PACKAGES, "geserve.settings"),
    "geserve.codecs": ("geserve.core", *BELOW_CORE, *FRONT_END_PACKAGES, "geserve.repository", "geserve.settings"),
    "geserve.settings": ("geserve.",),
    "geserve.restrictions": ("geserve.core", *BELOW_CORE, *FRONT_END_PACKAGES, "geserve.server"),
    "geserve.triton_flags": ("geserve.core", *BELOW_CORE, *FRONT_END_PACKAGES, "geserve.server"),
    "geserve.errors": ("geserve.",),
    # How every process writes its lines, worker processes (below the core) included: a leaf.
    "geserve.log_records": ("geserve.",),
    "geserve.env_flags": ("geserve.core", *BELOW_CORE, *FRONT_END_PACKAGES, "geserve.server"),
    "geserve.offload": ("geserve.",),
    "geserve.lingering": ("geserve.",),
    "geserve.abandonable": ("geserve.",),
    "geserve.free_ranges": ("geserve.",),
    "geserve.event_loop": ("geserve.",),
    "geserve.helper_process": ("geserve.",),
    "geserve.types": ("geserve.core", *BELOW_CORE, *FRONT_END_PACKAGES, "geserve.repository", "geserve.settings"),
    # The front door does a request's own work in whichever process reads it: it checks, places and answers,
    # and reaches the engine only through a link; it never schedules or runs a model.
    "geserve.frontdoor": (
        "geserve.batching",
        "geserve.backends",
        "geserve.core.service",
        "geserve.core.models",
        *FRONT_END_PACKAGES,
        "geserve.multiprocess",
        "geserve.server",
        "geserve.cli",
    ),
    # What crosses between the front door, the engine and the workers: leaves every side can import.
    **{
        module: ("geserve.core", *BELOW_CORE, "geserve.frontdoor", *FRONT_END_PACKAGES, "geserve.multiprocess")
        for module in ("geserve.residency", "geserve.snapshots", "geserve.submissions")
    },
    **{module: ("geserve.batching", "geserve.backends") for module in PROTOCOL_SIDE},
    "geserve.multiprocess.supervisor": SUPERVISOR_FORBIDDEN,
    # The steps, deadlines and ports every layout shares, the supervisor's included: nothing it must not load.
    "geserve.lifecycle": (*SUPERVISOR_FORBIDDEN, "geserve.frontdoor", "geserve.multiprocess"),
}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        if not name.startswith("geserve._generated"):
            found.append((name, path))
    return found


def _imports(source: str) -> set[str]:
    """Every module a source imports; `from a import b` counts as both `a` and `a.b` (b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# The front-ends see the core only through its API (and the leaves): the same code then serves an engine in
# this process or in another one.
FRONT_END_CORE_ALLOWED = ("geserve.core.api",)


def _past_core_api(imported: set[str], allowed: tuple[str, ...]) -> list[str]:
    return sorted(
        n
        for n in imported
        if (n == "geserve.core" or n.startswith("geserve.core."))
        and not any(n == a or n.startswith(a + ".") for a in allowed)
    )


def _violations(module: str, imported: set[str]) -> list[str]:
    problems = []
    if module.startswith(FRONT_END_PACKAGES):
        reaching = _past_core_api(imported, FRONT_END_CORE_ALLOWED)
        if reaching:
            problems.append(f"{module} reaches into core past its API: {reaching}")
    if module in PROTOCOL_SIDE:
        reaching = _past_core_api(imported, PROTOCOL_SIDE_CORE_ALLOWED)
        if reaching:
            problems.append(f"{module} is on the protocol side but reaches into core past its API: {reaching}")
    if not module.startswith(FRONT_ENDS):
        libraries = sorted(n for n in imported if n.split(".")[0] in FRONT_END_LIBRARIES)
        if libraries:
            problems.append(f"{module} sits below the front-ends but imports {libraries}")
    for layer, forbidden in FORBIDDEN.items():
        if module == layer or module.startswith(layer + "."):
            bad = sorted(
                n for n in imported if any(n == f or n.startswith(f if f.endswith(".") else f + ".") for f in forbidden)
            )
            if bad:
                problems.append(f"{module} must not import {bad}")
    return problems


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_dependency_direction(module: str, path: Path) -> None:
    assert not _violations(module, _imports(path.read_text()))


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("geserve.http.routes", "from geserve.workers.pool import InstancePool"),
        ("geserve.grpc.servicer", "from geserve import batching"),
        ("geserve.metrics.registry", "import geserve.backends.registry"),
        ("geserve.core.loader", "from geserve.workers import placement"),
        ("geserve.core.service", "from geserve.backends.registry import resolve"),
        ("geserve.workers.pool", "from geserve.http.app import create_app"),
        ("geserve.batching.scheduler", "from geserve.grpc import convert"),
        ("geserve.core.models", "import fastapi"),
        ("geserve.http.routes", "from geserve.core.service import InferenceService"),
        ("geserve.grpc.servicer", "from geserve.core import stats"),
        ("geserve.metrics.registry", "import geserve.core.stats"),
        ("geserve.multiprocess.remote", "from geserve.core.service import InferenceService"),
        ("geserve.multiprocess.protocol", "from geserve.core import stats"),
        ("geserve.multiprocess.calls", "import geserve.core"),
        ("geserve.multiprocess.framing", "from geserve.batching import scheduler"),
        ("geserve.multiprocess.connection_count", "import geserve.backends.base"),
        ("geserve.multiprocess.supervisor", "from geserve.server import Server"),
        ("geserve.multiprocess.supervisor", "from geserve.hosts import EngineHost"),
        ("geserve.lifecycle", "from geserve.hosts import ProtocolHost"),
        ("geserve.lifecycle", "from geserve.core.service import InferenceService"),
        ("geserve.multiprocess.supervisor", "import geserve.core.service"),
        ("geserve.multiprocess.supervisor", "from geserve.http.app import create_app"),
        ("geserve.multiprocess.supervisor", "from geserve.grpc import server"),
        ("geserve.multiprocess.supervisor", "from geserve.listeners import http_listener"),
        ("geserve.multiprocess.supervisor", "from geserve.multiprocess.engine import serve_engine"),
        ("geserve.multiprocess.supervisor", "from geserve.multiprocess import protocol"),
        ("geserve.multiprocess.supervisor", "def start():\n    from geserve.core.service import InferenceService"),
        ("geserve.multiprocess.child", "from geserve.cli import loop_factory"),
        ("geserve.multiprocess.engine", "def serve():\n    from geserve import cli"),
        ("geserve.atc.host", "from geserve.workers import devices"),
        ("geserve.atc.compiler", "def compile():\n    import geserve.workers.pool"),
    ],
)
def test_the_rules_catch_what_the_picture_forbids(module: str, source: str) -> None:
    assert _violations(module, _imports(source))


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("geserve.multiprocess.remote", "from geserve.core.api import InferenceAPI"),
        ("geserve.multiprocess.protocol", "from geserve.core.log_control import LogControl"),
        ("geserve.multiprocess.protocol", "from geserve.listeners import http_listener"),
        ("geserve.multiprocess.engine", "from geserve.hosts import EngineHost"),
        ("geserve.multiprocess.supervisor", "from geserve.lifecycle import ShutdownPlan"),
        ("geserve.multiprocess.supervisor", "from geserve.multiprocess.child import run_child"),
        ("geserve.multiprocess.supervisor", "from geserve.workers.runs import RunId"),
        ("geserve.listeners", "import uvicorn"),
        ("geserve.workers.devices", "from geserve.atc import host"),
        ("geserve.backends.acl.soc", "from geserve.atc import chips"),
        ("geserve.multiprocess.child", "from geserve.event_loop import loop_factory"),
    ],
)
def test_the_rules_allow_what_the_picture_allows(module: str, source: str) -> None:
    assert not _violations(module, _imports(source))


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_every_module_has_a_one_line_docstring(module: str, path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring, f"{module} has no module docstring"
    assert "\n" not in docstring.strip(), f"{module}'s docstring should be one line"


def _module_named(imported: str, modules: set[str]) -> str | None:
    """The geserve module an imported name loads: itself, or the module that defines it (`a.b.name` -> `a.b`)."""
    while imported and imported not in modules:
        imported = imported.rpartition(".")[0]
    return imported or None


def _imported_modules(module: str, path: Path, modules: set[str]) -> set[str]:
    """The geserve modules `module` imports anywhere: at the top, in a function, under TYPE_CHECKING. `from a import
    b` imports module `a.b` when there is one, else module `a` (b is a name defined there)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(_module_named(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            found.update(_module_named(f"{base}.{alias.name}", modules) for alias in node.names)
    return {name for name in found if name is not None and name != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative): each is a set of
    modules every one of which imports, directly or not, every other."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            following = next((n for n in edges if n not in index or n in on_stack), None)
            if following is not None:
                if following in index:
                    lowlink[node] = min(lowlink[node], index[following])
                else:
                    index[following] = lowlink[following] = len(index)
                    stack.append(following)
                    on_stack.add(following)
                    work.append((following, iter(sorted(graph[following]))))
                continue
            work.pop()
            if work:
                lowlink[work[-1][0]] = min(lowlink[work[-1][0]], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _a_cycle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle through a component's first module, for the failure to name (breadth first: the shortest)."""
    start = component[0]
    members = set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    return component


def _import_graph() -> dict[str, set[str]]:
    found = _modules()
    names = {name for name, _ in found}
    return {name: _imported_modules(name, path, names) for name, path in found}


def test_no_module_imports_itself_through_others() -> None:
    graph = _import_graph()
    circles = [" -> ".join(_a_cycle(component, graph)) for component in _cycles(graph)]
    assert not circles, "import cycles between geserve modules:\n" + "\n".join(circles)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_cycle_finder_finds_every_circle(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert sorted(_cycles(graph)) == expected
    for component in expected:
        circle = _a_cycle(component, graph)
        assert circle[0] == circle[-1] and all(b in graph[a] for a, b in itertools.pairwise(circle))


def test_function_level_and_type_checking_imports_count(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from geserve.core import models\n"
        "if TYPE_CHECKING:\n    from geserve.core.stats import ModelStats\n"
        "def late():\n    import geserve.cli\n    from geserve.workers import batch\n"
    )
    modules = {"geserve.core", "geserve.core.models", "geserve.core.stats", "geserve.cli", "geserve.workers.batch"}
    found = _imported_modules("geserve.x", source, modules)
    assert found == {"geserve.core.models", "geserve.core.stats", "geserve.cli", "geserve.workers.batch"}
