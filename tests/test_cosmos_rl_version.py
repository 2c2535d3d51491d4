"""The cosmos-rl guard refuses every cosmos-rl but 0.4.7, before changing anything.

Runs in the main environment, where cosmos-rl is not installed (it pins transformers<5, vLLM
for CPU needs >=5.16). The guard's behaviour on cosmos-rl itself is tested in tests/cosmos_rl_env/,
which ./run_test.sh runs in .venv-cosmos.
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from rollout_sync.errors import CosmosRLVersionError, RolloutSyncError
from rollout_sync.integrations import cosmos_rl


def _cosmos_rl_installed() -> bool:
    try:
        importlib.metadata.version("cosmos-rl")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(_cosmos_rl_installed(), reason="cosmos-rl is installed here")
def test_install_without_cosmos_rl_says_what_to_install() -> None:
    with pytest.raises(CosmosRLVersionError, match=r"cosmos-rl==0\.4\.7"):
        cosmos_rl.install()
    assert cosmos_rl._installed is None


@pytest.mark.parametrize("found", ["0.4.6", "0.4.8", "0.5.0"])
def test_other_versions_are_refused(monkeypatch: pytest.MonkeyPatch, found: str) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        return found if name == "cosmos-rl" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(
        CosmosRLVersionError, match=rf"supports cosmos-rl 0\.4\.7 only.*found {re.escape(found)}"
    ):
        cosmos_rl.install()
    with pytest.raises(CosmosRLVersionError), cosmos_rl.installed():
        pass
    assert cosmos_rl._installed is None


def test_the_error_is_an_import_error_of_the_package() -> None:
    assert issubclass(CosmosRLVersionError, ImportError)
    assert issubclass(CosmosRLVersionError, RolloutSyncError)
    assert cosmos_rl.SUPPORTED_VERSION == "0.4.7"


def test_uninstall_when_not_installed_is_a_no_op() -> None:
    cosmos_rl.uninstall()
    assert cosmos_rl._installed is None
