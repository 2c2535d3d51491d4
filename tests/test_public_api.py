"""The public surface: a small root namespace by role, modules for the rest, errors in one place.

``__all__`` says exactly what the root exports; every name a role needs is there; the root stays
within 50 names; names it exported before resolve for one release with a DeprecationWarning that
names their module; every exception class lives in ``rollout_sync.errors``; the library raises
its own timeouts, never a bare ``TimeoutError``; ``demos`` is imported by nothing else.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import pickle
import pkgutil
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest

import rollout_sync
import rollout_sync.errors

PACKAGE = Path(rollout_sync.__file__).parent

# The names each role imports from the root; a rename shows up here first (docs/api.md).
PROMISED = {
    "backend authors": [
        "RolloutBase",
        "ThreadedRolloutBackend",
        "KVCachePolicy",
        "RolloutTaskScheduler",
        "DecodeEngine",
        "GenerationRequest",
        "GenerationResult",
        "SamplingParams",
        "WeightBuffer",
        "SupportsWeightBuffer",
        "install_inference_sync",
        "Gate",
    ],
    "frameworks decorating handlers": [
        "weight_sync_handler",
        "pauses_generation",
        "holds_payload_egress",
        "weight_sync_bracket",
        "WeightSyncWorker",
        "SyncMode",
        "SyncReport",
        "RolloutWorker",
        "P2R",
        "R2R",
        "Stop",
        "WorkerCommandChannel",
        "build_sync_groups",
        "SyncGroups",
        "WeightTransfer",
        "TransferConfig",
    ],
    "payload packers": [
        "payload_egress_held",
        "SupportsHoldSends",
        "SupportsFlushPendingSends",
        "NCCLRolloutMixin",
        "PayloadSender",
        "PayloadReceiver",
        "new_payload_groups",
    ],
    "the trainer side": [
        "TrainerCallback",
        "TrainerCallbacks",
        "WeightBroadcastCallback",
        "TransferWeightPusher",
        "WeightSyncTimer",
        "merge_step_metrics",
    ],
    "errors and tracing": [
        "RolloutSyncError",
        "PauseTimeout",
        "EgressHoldTimeout",
        "TornWeightsError",
        "WeightTransferError",
        "WeightMismatchError",
        "WorkerContractError",
        "Timeline",
        "SpanKind",
    ],
}


# Modules that import cosmos-rl at import time: skipped here without it; tests/cosmos_rl_env/
# (run in .venv-cosmos) checks that they define no exception class of their own.
_NEEDS_COSMOS_RL = {"rollout_sync.integrations.cosmos_rl_payload", "rollout_sync.testing.cosmos_rl"}


def _library_modules() -> list[str]:
    have_cosmos_rl = importlib.util.find_spec("cosmos_rl") is not None
    return [
        info.name
        for info in pkgutil.walk_packages([str(PACKAGE)], prefix="rollout_sync.")
        if not info.name.startswith("rollout_sync.demos")
        and (have_cosmos_rl or info.name not in _NEEDS_COSMOS_RL)
    ]


def test_all_matches_the_names_the_package_exports() -> None:
    exported = {
        name
        for name, value in vars(rollout_sync).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert sorted(rollout_sync.__all__) == sorted(exported)
    assert len(set(rollout_sync.__all__)) == len(rollout_sync.__all__)


def test_the_root_keeps_at_most_fifty_names_and_each_belongs_to_a_role() -> None:
    assert len(rollout_sync.__all__) <= 50
    promised = [name for names in PROMISED.values() for name in names]
    assert sorted(promised) == sorted(rollout_sync.__all__)


@pytest.mark.parametrize("role", sorted(PROMISED))
def test_promised_names_are_public(role: str) -> None:
    missing = [n for n in PROMISED[role] if n not in rollout_sync.__all__]
    assert not missing
    assert all(getattr(rollout_sync, n) is not None for n in PROMISED[role])


@pytest.mark.parametrize("name", sorted(rollout_sync._MOVED))
def test_a_name_the_root_no_longer_exports_still_resolves_with_a_deprecation_warning(
    name: str,
) -> None:
    module = importlib.import_module(f"rollout_sync.{rollout_sync._MOVED[name]}")
    with pytest.warns(DeprecationWarning, match=rf"rollout_sync\.{rollout_sync._MOVED[name]}"):
        value = getattr(rollout_sync, name)
    assert value is getattr(module, name)


def test_the_version_is_the_installed_distributions() -> None:
    assert rollout_sync.__version__ == importlib.metadata.version("rollout-sync")
    assert re.fullmatch(r"\d+\.\d+\.\d+", rollout_sync.__version__)


def test_a_deprecation_names_the_release_it_refers_to() -> None:
    from rollout_sync._moved import DEPRECATED_IN, REMOVED_IN

    def release(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("."))

    # Old paths live from the release they moved in until the one that removes them.
    assert release(DEPRECATED_IN) <= release(rollout_sync.__version__) < release(REMOVED_IN)
    with pytest.warns(DeprecationWarning) as caught:
        rollout_sync.TinyCausalLM  # noqa: B018
    message = str(caught[0].message)
    assert f"deprecated since {DEPRECATED_IN}" in message and f"away in {REMOVED_IN}" in message


def test_from_import_of_an_old_root_name_works_and_warns() -> None:
    with pytest.warns(DeprecationWarning, match="rollout_sync.backends.torch_lm"):
        from rollout_sync import TinyCausalLM
    from rollout_sync.backends.torch_lm import TinyCausalLM as moved

    assert TinyCausalLM is moved


def test_an_unknown_root_name_is_an_attribute_error_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
            _ = rollout_sync.NoSuchName


def test_every_exception_class_lives_in_errors() -> None:
    strays = []
    for module_name in _library_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module_name
                and module_name != "rollout_sync.errors"
            ):
                strays.append(f"{module_name}.{name}")
    assert not strays, f"exception classes outside rollout_sync/errors.py: {strays}"


def test_every_error_is_a_rollout_sync_error_and_every_timeout_a_rollout_sync_timeout() -> None:
    """One hierarchy: every timeout the package raises is caught by ``RolloutSyncTimeout`` (and
    by the builtin ``TimeoutError``), whatever family it also belongs to."""
    timeouts = []
    for name in rollout_sync.errors.__all__:
        cls = getattr(rollout_sync.errors, name)
        if cls is rollout_sync.errors.ChildFailure:
            continue  # the record GroupProcessError carries, not an exception
        assert issubclass(cls, rollout_sync.errors.RolloutSyncError), name
        if name.endswith("Timeout") or issubclass(cls, TimeoutError):
            assert issubclass(cls, rollout_sync.errors.RolloutSyncTimeout), name
            assert issubclass(cls, TimeoutError), name
            timeouts.append(name)
    assert len(timeouts) >= 20, timeouts  # the scan saw them all
    # The families still catch their own timeouts.
    errors = rollout_sync.errors
    assert issubclass(errors.WeightTransferTimeout, errors.WeightTransferError)
    assert issubclass(errors.CollectiveTimeout, errors.CollectiveError)
    assert issubclass(errors.PauseTimeout, errors.GateTimeout)


def test_one_class_for_a_missing_dependency_under_every_old_name() -> None:
    errors = rollout_sync.errors
    old = [
        errors.VLLMUnavailableError,
        errors.RayUnavailableError,
        errors.RedisUnavailableError,
        errors.MatplotlibUnavailableError,
        errors.CosmosRLVersionError,
    ]
    assert all(cls is errors.MissingDependencyError for cls in old)
    assert issubclass(errors.MissingDependencyError, ImportError)
    added = errors.MissingDependencyError("RayJob needs Ray", package="ray", extra="ray")
    assert str(added) == "RayJob needs Ray; pip install 'rollout-sync[ray]'"
    said = errors.MissingDependencyError(
        "x: pip install 'rollout-sync[plot]'", package="m", extra="plot"
    )
    assert str(said).count("pip install") == 1
    plain = errors.MissingDependencyError("apt-get install -y redis-server", package="redis-server")
    assert (plain.package, plain.extra, str(plain)) == (
        "redis-server",
        None,
        "apt-get install -y redis-server",
    )
    copy = pickle.loads(pickle.dumps(added))
    assert (type(copy), copy.package, copy.extra, str(copy)) == (
        errors.MissingDependencyError,
        "ray",
        "ray",
        str(added),
    )


def test_a_missing_redis_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_sync.testing.redis_server import require_redis_server

    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server: the executable is checked first")
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis raises ImportError
    with pytest.raises(rollout_sync.errors.RedisUnavailableError) as caught:
        require_redis_server()
    assert (caught.value.package, caught.value.extra) == ("redis", "fast-llm")
    assert "pip install 'rollout-sync[fast-llm]'" in str(caught.value)


def test_merged_errors_are_caught_by_every_old_name() -> None:
    """An old name that became an alias catches what it caught (and what it merged with)."""
    errors = rollout_sync.errors
    with pytest.raises(errors.SchedulerTimeout):
        raise errors.GenerationTimeout("request 3 did not finish within 1.0 s")
    with pytest.raises(errors.WriteRefused, match="repacked"):
        raise errors.WeightMismatchError(["qkv.weight: repacked"], context="weights copied")
    assert errors.ChildFailure(0, 1, "boom") == pickle.loads(
        pickle.dumps(errors.ChildFailure(0, 1, "boom"))
    )


def _raised_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name):
                found.append(target.id)
            elif isinstance(target, ast.Attribute):  # builtins.TimeoutError, ...
                found.append(target.attr)
    return found


def test_the_library_never_raises_a_bare_timeout_error() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "TimeoutError" in _raised_names(path)
    ]
    assert not offenders, f"raise TimeoutError(...) in {offenders}: raise an errors.py subclass"


def test_nothing_outside_demos_imports_demos() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "demos" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                # from .demos import x, from rollout_sync.demos.cli import y, from . import demos
                module = "." * node.level + (node.module or "")
                names = [*module.split("."), *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):  # import rollout_sync.demos.cli
                names = [part for alias in node.names for part in alias.name.split(".")]
            else:
                continue
            if "demos" in names:
                offenders.append(str(path.relative_to(PACKAGE)))
    assert not offenders


def test_backends_holds_engines_only() -> None:
    """One module or package per engine; the rest are stand-ins for paths that moved into
    ``vllm/`` (test_layout.py checks that they warn and resolve)."""
    entries = sorted(
        p.stem if p.suffix == ".py" else p.name + "/"
        for p in (PACKAGE / "backends").iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    )
    engines = [e for e in entries if not _is_stand_in(PACKAGE / "backends" / f"{e}.py")]
    stand_ins = [e for e in entries if e not in engines]
    assert engines == ["__init__", "torch_lm/", "vllm/"]
    assert stand_ins == [f"vllm_{part}" for part in sorted(VLLM_PARTS_MOVED)]


VLLM_PARTS_MOVED = {"client", "engine", "park", "plugin", "trainer", "worker"}


def _is_stand_in(path: Path) -> bool:
    return path.is_file() and "resolve_moved(__name__" in path.read_text()


def _api_doc() -> tuple[set[str], dict[str, list[str]]]:
    """docs/api.md: the names its root tables list, and the names its module table lists."""
    text = (PACKAGE.parent / "docs" / "api.md").read_text()
    root_part, module_part = text.split("## Everything else, by module")
    module_part = module_part.split("## Names the root exported")[0]
    root: set[str] = set()
    for line in root_part.splitlines():
        if line.startswith("| `"):
            root.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    modules: dict[str, list[str]] = {}
    for line in module_part.splitlines():
        if line.startswith("| `rollout_sync"):
            cells = line.split("|")
            module = cells[1].strip().strip("`")
            modules[module] = re.findall(r"`(\w+)`", cells[2])
    return root, modules


def test_the_api_page_lists_exactly_the_root_names() -> None:
    root, _ = _api_doc()
    assert root == set(rollout_sync.__all__)


def test_every_name_the_api_page_places_in_a_module_is_there() -> None:
    _, modules = _api_doc()
    missing = []
    for module_name, names in modules.items():
        module = importlib.import_module(module_name)
        missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    assert not missing
    # Every error the package defines is on the page.
    assert set(rollout_sync.errors.__all__) <= {
        *modules["rollout_sync.errors"],
        *(n for n in rollout_sync.__all__ if n in rollout_sync.errors.__all__),
    }
