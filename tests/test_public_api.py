"""The public surface: everything in __all__ is exported, and nothing public is left out."""

from __future__ import annotations

import rollout_sync


def test_all_matches_the_names_the_package_exports() -> None:
    exported = {
        name for name, value in vars(rollout_sync).items()
        if not name.startswith("_") and not isinstance(value, type(rollout_sync))
    }
    assert sorted(rollout_sync.__all__) == sorted(exported)
    assert len(set(rollout_sync.__all__)) == len(rollout_sync.__all__)
    for name in rollout_sync.__all__:
        assert getattr(rollout_sync, name) is not None

