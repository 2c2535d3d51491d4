"""The package's rooms: no import circle anywhere in ``rollout_sync``, and every path that moved
still resolves, for one release, to the same object with a warning that names the new path.

The import graph is read from the source (every ``import`` and ``from ... import``, at module
level, in functions and under ``TYPE_CHECKING`` alike), one node per module; importing a
submodule implies its package's ``__init__``, which is not counted as an edge.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rollout_sync"

MOVED_MODULES = {
    "rollout_sync.backends.vllm_worker": "rollout_sync.backends.vllm.worker",
    "rollout_sync.backends.vllm_engine": "rollout_sync.backends.vllm.engine",
    "rollout_sync.backends.vllm_trainer": "rollout_sync.backends.vllm.trainer",
    "rollout_sync.backends.vllm_client": "rollout_sync.backends.vllm.client",
    "rollout_sync.backends.vllm_park": "rollout_sync.backends.vllm.park",
    "rollout_sync.backends.vllm_plugin": "rollout_sync.backends.vllm.plugin",
    "rollout_sync.integrations.launch": "rollout_sync.launch",
    "rollout_sync.integrations.ray": "rollout_sync.launch.ray",
}
"""Old module path -> the module that has its names now."""

IMPORTS_VLLM = {"rollout_sync.backends.vllm.park"}


# -- the import graph ----------------------------------------------------------------------------


def _module_name(package_root: Path, path: Path) -> str:
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package_root: Path) -> dict[str, set[str]]:
    """Each module of the package under ``package_root`` -> the package's modules it imports."""
    files = {_module_name(package_root, p): p for p in package_root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in files else source)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph(PACKAGE)
    assert "rollout_sync.backends.vllm.backend" in graph  # the walk saw the subpackages
    assert import_cycles(graph) == []


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """The check above can fail: a package whose modules import each other, one of them only
    inside a function, is reported, and so is a three-module ring through a subpackage."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from .b import thing\n",
        "b.py": "def thing():\n    from . import a\n    return a\n",
        "c.py": "import pkg.sub.d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..e import x\n",
        "e.py": "from .c import y\n",
        "f.py": "from .a import thing\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    cycles = import_cycles(import_graph(pkg))
    assert sorted(cycles) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.e", "pkg.sub.d"]]


# -- paths that moved ----------------------------------------------------------------------------


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_path_gives_the_same_object_with_a_warning_naming_the_new(old: str) -> None:
    new = MOVED_MODULES[old]
    if new in IMPORTS_VLLM:
        pytest.importorskip("vllm")
    new_module = importlib.import_module(new)
    old_module = importlib.import_module(old)
    names = list(new_module.__all__)
    assert names
    for name in names:
        with pytest.warns(DeprecationWarning, match=rf"import it from {new}\b") as caught:
            value = getattr(old_module, name)
        assert value is getattr(new_module, name), name
        assert caught[0].filename == __file__  # the warning points at the caller
    with pytest.raises(AttributeError, match=rf"moved to '{new}'"):
        old_module.no_such_name  # noqa: B018


def test_from_import_of_an_old_path_warns_at_every_import() -> None:
    from rollout_sync.backends.vllm.client import GuardedWeightSyncClient as new

    for _ in range(2):
        with pytest.warns(DeprecationWarning, match="rollout_sync.backends.vllm.client"):
            from rollout_sync.backends.vllm_client import GuardedWeightSyncClient as old
        assert old is new


CONFIG_STRINGS = {
    # worker_extension_cls, as users put it in vLLM's engine arguments
    "rollout_sync.backends.vllm_worker.RolloutSyncWorkerExtension": (
        "rollout_sync.backends.vllm.worker.RolloutSyncWorkerExtension"
    ),
    # scheduler_cls, the parking scheduler
    "rollout_sync.backends.vllm_park.parking_scheduler": (
        "rollout_sync.backends.vllm.park.parking_scheduler"
    ),
}


@pytest.mark.vllm
@pytest.mark.parametrize("old", sorted(CONFIG_STRINGS))
def test_an_old_configuration_string_resolves_the_way_vllm_resolves_it(old: str) -> None:
    pytest.importorskip("vllm")
    from vllm.utils.import_utils import resolve_obj_by_qualname

    with pytest.warns(DeprecationWarning, match="rollout_sync.backends.vllm."):
        value = resolve_obj_by_qualname(old)
    assert value is resolve_obj_by_qualname(CONFIG_STRINGS[old])


@pytest.mark.vllm
@pytest.mark.timeout(60)
def test_the_vllm_plugin_entry_point_resolves_in_a_fresh_process() -> None:
    """vLLM loads ``vllm.general_plugins`` by entry point name in each process it starts; the
    name is unchanged and resolves to the new module without a deprecation warning. (That the
    plugin then registers the engines inside vLLM's processes, the native-API tests show: their
    engines come from it.)"""
    pytest.importorskip("vllm")
    code = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("error", DeprecationWarning)
        from importlib.metadata import entry_points
        points = entry_points(group="vllm.general_plugins")
        (point,) = [p for p in points if p.name == "rollout_sync"]
        assert point.value == "rollout_sync.backends.vllm.plugin:register_engines", point.value
        register = point.load()
        from rollout_sync.backends.vllm.plugin import ENGINE_NAME, register_engines
        assert register is register_engines
        import sys
        assert "vllm" not in sys.modules  # resolving the entry point is cheap, as vLLM expects
        print("resolved", ENGINE_NAME)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resolved rollout_sync" in done.stdout
