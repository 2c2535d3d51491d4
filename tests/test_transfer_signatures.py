"""Every weight transfer takes the same arguments, the ones the worker's protocol names; and
what every transfer returns, :class:`~rollout_sync.transfer.TransferStats`, is built by keyword.

``receive``, ``relay``, ``send``, ``abort`` and ``is_source`` of each implementation of
:class:`rollout_sync.worker.SupportsWeightTransfer` in the package (found by scanning it, so a
new one is checked the day it lands) agree with each other exactly: parameter names, kinds and
defaults. Each also takes every parameter of the protocol, in its order and kind, with a
default wherever the protocol has one; what an implementation takes beyond the protocol is
keyword-only with a default, so a caller that knows only the protocol never misses it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path
from typing import Any

import pytest

import rollout_sync
from rollout_sync.sharded_groups import TreeRelay
from rollout_sync.testing.emulated_nic import PacedShardedTransfer, PacedWeightTransfer
from rollout_sync.transfer import ShardedTransfer, TransferStats, WeightTransfer
from rollout_sync.worker import SupportsWeightTransfer

PACKAGE = Path(rollout_sync.__file__).parent
METHODS = ("receive", "relay", "send", "abort")
MEMBERS = ("is_source", *METHODS)
_NEEDS_COSMOS_RL = {"rollout_sync.integrations.cosmos_rl_payload", "rollout_sync.testing.cosmos_rl"}


def _implementations() -> list[type[Any]]:
    """Every class of the package with all the protocol's members (protocols excluded)."""
    have_cosmos_rl = importlib.util.find_spec("cosmos_rl") is not None
    found: dict[str, type[Any]] = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="rollout_sync."):
        if info.name.startswith("rollout_sync.demos") or (
            not have_cosmos_rl and info.name in _NEEDS_COSMOS_RL
        ):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and value.__module__ == info.name
                and not getattr(value, "_is_protocol", False)
                and all(hasattr(value, member) for member in MEMBERS)
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[name] for name in sorted(found)]


IMPLEMENTATIONS = _implementations()


def _shape(function: Any) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of every parameter but ``self``."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in parameters]


def test_the_scan_finds_every_known_transfer() -> None:
    known = {WeightTransfer, ShardedTransfer, TreeRelay, PacedWeightTransfer, PacedShardedTransfer}
    assert known <= set(IMPLEMENTATIONS), IMPLEMENTATIONS


@pytest.mark.parametrize("method", METHODS)
def test_every_transfer_takes_the_same_arguments(method: str) -> None:
    first, *others = IMPLEMENTATIONS
    expected = _shape(getattr(first, method))
    for cls in others:
        assert _shape(getattr(cls, method)) == expected, (cls.__qualname__, first.__qualname__)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda cls: cls.__qualname__)
def test_every_transfer_takes_what_the_protocol_names(cls: type[Any], method: str) -> None:
    promised = _shape(getattr(SupportsWeightTransfer, method))
    taken = _shape(getattr(cls, method))
    where = f"{cls.__qualname__}.{method}"
    promised_names = [name for name, _, _ in promised]
    assert [name for name, _, _ in taken if name in promised_names] == promised_names, where
    by_name = {name: (kind, default) for name, kind, default in taken}
    for name, kind, default in promised:
        assert by_name[name][0] == kind, f"{where}({name}): not {kind}"
        if default is not inspect.Parameter.empty:
            assert by_name[name][1] is not inspect.Parameter.empty, f"{where}({name}): no default"
    for name, kind, default in taken:
        if name not in promised_names:  # beyond the protocol: optional, by keyword only
            assert kind is inspect.Parameter.KEYWORD_ONLY, f"{where}({name})"
            assert default is not inspect.Parameter.empty, f"{where}({name})"


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda cls: cls.__qualname__)
def test_is_source_is_a_read_only_property_as_in_the_protocol(cls: type[Any]) -> None:
    assert isinstance(inspect.getattr_static(SupportsWeightTransfer, "is_source"), property)
    member = inspect.getattr_static(cls, "is_source")
    assert isinstance(member, property) and member.fset is None, cls.__qualname__


@pytest.mark.parametrize("method", ["receive", "relay"])
def test_a_receive_accepts_a_declared_subset_by_default_on_every_transfer(method: str) -> None:
    """One default (docs/distributed.md): a subset the sender declared (a manifest with
    ``require_all=False``, a plan over subset layouts) is accepted unless the receiver passes
    ``allow_subset=False``; a full sync must name every target either way."""
    for cls in IMPLEMENTATIONS:
        default = inspect.signature(getattr(cls, method)).parameters["allow_subset"].default
        assert default is True, cls.__qualname__


def test_transfer_stats_build_takes_every_field_by_keyword_with_its_default() -> None:
    """The builder names exactly the dataclass's fields (so the two cannot drift apart) and
    builds what positional construction builds."""
    fields = dataclasses.fields(TransferStats)
    parameters = inspect.signature(TransferStats.build).parameters
    assert list(parameters) == [f.name for f in fields]
    for f in fields:
        parameter = parameters[f.name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, f.name
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert parameter.default == default, f.name
    built = TransferStats.build(
        role="receive",
        version=3,
        tensors=2,
        buckets=1,
        nbytes=64,
        manifest_s=0.5,
        transfer_s=1.5,
        total_s=2.0,
        tensors_written=2,
        layout="L",
    )
    assert built == TransferStats("receive", 3, 2, 1, 64, 0.5, 1.5, 2.0, 2, layout="L")
    assert built.mb_per_s == 64 / 1e6 / 2.0
