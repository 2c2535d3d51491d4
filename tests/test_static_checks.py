"""The package stays lint-clean, formatted and strictly typed (STYLE.md: ruff and mypy --strict).

The tools come with the ``test`` extra; where one is missing the check skips rather than fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ["rollout_sync", "tests", "benchmarks", "docs/examples"]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


def _run(*argv: str, timeout: float) -> None:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.timeout(120)
def test_ruff_lint_and_format() -> None:
    ruff = _tool("ruff")
    _run(ruff, "check", *CODE, timeout=100)
    _run(ruff, "format", "--check", *CODE, timeout=100)


@pytest.mark.timeout(400)
def test_mypy_strict_on_the_package() -> None:
    _run(_tool("mypy"), "rollout_sync", timeout=380)
