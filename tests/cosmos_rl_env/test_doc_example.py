"""docs/cosmos_rl.md's example (docs/examples/cosmos_rl_install.py), run where cosmos-rl is.

The main suite registers the file too (tests/test_doc_examples.py), and skips it there: cosmos-rl
0.4.7 lives in .venv-cosmos only. Here it runs in this process, where cosmos is imported once
for the whole directory, rather than in a new interpreter that would import it again.
"""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path

import pytest

if importlib.util.find_spec("cosmos_rl") is None:
    pytest.skip("cosmos-rl 0.4.7 is tested in .venv-cosmos", allow_module_level=True)

from rollout_sync.integrations import cosmos_rl  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "cosmos_rl_install.py"


@pytest.mark.timeout(120)
def test_the_install_example_of_the_docs_runs() -> None:
    try:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        cosmos_rl.uninstall()  # whatever the example left: the other tests start uninstalled
