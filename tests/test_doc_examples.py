"""The docs' Python examples are files that run, and the docs show exactly those files' text.

Every ```python block in README.md and docs/*.md is preceded (on the line before its fence) by
one of two markers:

* ``<!-- example: docs/examples/NAME.py -->`` - the block is the file's text, or with
  ``#REGION`` the text between ``# [doc:REGION]`` and ``# [/doc:REGION]`` in it (dedented). The
  file around a region holds the smallest honest fill-ins (a tiny model, local processes), so
  the block cannot drift from code that runs: :data:`EXAMPLES` runs each file.
* ``<!-- fragment: WHY -->`` - a block that is not a program (a diff of two lines, a shape of
  calls whose whole is an example elsewhere); WHY says so.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES_DIR = ROOT / "docs" / "examples"

MARKER = re.compile(r"<!-- (example|fragment): (.+?) -->")
FENCE = "```python"


@dataclass(frozen=True)
class DocBlock:
    doc: Path
    line: int
    text: str
    kind: str | None
    """``"example"``, ``"fragment"``, or ``None`` (no marker: an error)."""
    target: str


def doc_blocks(path: Path) -> list[DocBlock]:
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == FENCE:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
            blocks.append(
                DocBlock(
                    path,
                    i + 1,
                    "\n".join(lines[i + 1 : end]),
                    marker.group(1) if marker else None,
                    marker.group(2) if marker else "",
                )
            )
            i = end
        i += 1
    return blocks


def region(path: Path, name: str | None) -> str:
    """The file's text, or its region ``name`` dedented, without trailing blank lines."""
    text = path.read_text()
    if name is not None:
        found = re.search(
            rf"^[ \t]*# \[doc:{re.escape(name)}\]\n(.*?)^[ \t]*# \[/doc:{re.escape(name)}\]",
            text,
            re.S | re.M,
        )
        assert found, f"{path.name} has no region {name!r}"
        text = textwrap.dedent(found.group(1))
    return text.rstrip()


ALL_BLOCKS = [block for doc in DOCS for block in doc_blocks(doc)]


def _id(block: DocBlock) -> str:
    return f"{block.doc.name}:{block.line}"


def test_every_python_block_in_the_docs_is_an_example_or_says_why_not() -> None:
    unmarked = [_id(b) for b in ALL_BLOCKS if b.kind is None]
    assert not unmarked, (
        "python blocks without <!-- example: ... --> or <!-- fragment: ... --> on the line "
        f"before: {unmarked}"
    )


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.kind == "example"], ids=_id)
def test_a_doc_example_is_the_text_of_its_file(block: DocBlock) -> None:
    file_part, _, name = block.target.partition("#")
    path = ROOT / file_part
    assert path.is_file(), f"{_id(block)} names {file_part}, which does not exist"
    assert block.text.rstrip() == region(path, name or None), (
        f"{_id(block)} differs from {block.target}: change the file, then paste it"
    )


def test_every_example_file_is_shown_and_run() -> None:
    shown = {b.target.partition("#")[0] for b in ALL_BLOCKS if b.kind == "example"}
    files = {str(p.relative_to(ROOT)) for p in EXAMPLES_DIR.glob("*.py")}
    assert files == shown, "an example file no doc shows, or a doc shows a missing file"
    assert files == {f"docs/examples/{name}" for name in EXAMPLES}, "run every example"


def test_the_checks_catch_a_drifted_block_and_an_unmarked_one(tmp_path: Path) -> None:
    """The checks above can fail: a block that no longer matches its file's region, and a
    block with no marker, are both seen."""
    (tmp_path / "ex.py").write_text(
        "setup = 1\nif True:\n    # [doc:main]\n    print(setup + 1)\n    # [/doc:main]\n"
    )
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- example: ex.py#main -->\n```python\nprint(setup + 2)\n```\n\n```python\nx = 1\n```\n"
    )
    drifted, unmarked = doc_blocks(doc)
    assert drifted.kind == "example" and drifted.target == "ex.py#main"
    assert region(tmp_path / "ex.py", "main") == "print(setup + 1)" != drifted.text
    assert unmarked.kind is None


@dataclass(frozen=True)
class Example:
    timeout_s: float
    marks: tuple[pytest.MarkDecorator, ...] = ()


EXAMPLES: dict[str, Example] = {
    # -- README.md, docs/distributed.md, docs/transport.md, docs/metrics.md --------------------
    "using_it.py": Example(60),
    # -- docs/backends.md -------------------------------------------------------------------------
    "paused_contract.py": Example(90),
    "engine_registry.py": Example(60),
    "metrics_logger.py": Example(60),
    "flat_weights.py": Example(90, (pytest.mark.multiprocess,)),
    "pipelined_relay.py": Example(90, (pytest.mark.multiprocess,)),
    "sharded_trainer.py": Example(90, (pytest.mark.multiprocess,)),
    "rollout_worker.py": Example(90, (pytest.mark.multiprocess,)),
    "payload_transport.py": Example(90, (pytest.mark.multiprocess,)),
    "payload_hold.py": Example(90, (pytest.mark.multiprocess,)),
    "recovery.py": Example(90, (pytest.mark.multiprocess,)),
    # -- docs/scale.md -------------------------------------------------------------------------
    "scale_model.py": Example(60),
    # -- docs/vllm.md, docs/deploy.md, docs/fast_llm.md, docs/cosmos_rl.md ---------------------
    # Two vLLM engines, each ~30-60 s to start on two cores; the vLLM marker selects it.
    "vllm_backend.py": Example(
        420,
        (
            pytest.mark.vllm,
            pytest.mark.timeout(480),
            pytest.mark.skipif(not importlib.util.find_spec("vllm"), reason="needs vLLM"),
        ),
    ),
    "deploy_torchrun.py": Example(
        180, (pytest.mark.launcher, pytest.mark.multiprocess, pytest.mark.timeout(200))
    ),
    "deploy_ray.py": Example(
        240,
        (
            pytest.mark.launcher,
            pytest.mark.timeout(260),
            pytest.mark.skipif(not importlib.util.find_spec("ray"), reason="needs Ray"),
        ),
    ),
    "fast_llm_receiver.py": Example(
        90,
        (
            pytest.mark.redis,
            pytest.mark.multiprocess,
            pytest.mark.skipif(
                not (shutil.which("redis-server") and importlib.util.find_spec("redis")),
                reason="needs redis-server and the redis client",
            ),
        ),
    ),
    # Runs in .venv-cosmos, from tests/cosmos_rl_env/test_doc_example.py.
    "cosmos_rl_install.py": Example(
        120,
        (
            pytest.mark.timeout(150),
            pytest.mark.skipif(
                not importlib.util.find_spec("cosmos_rl"), reason="cosmos-rl: .venv-cosmos"
            ),
        ),
    ),
}
"""Each file under docs/examples/ and how it runs."""


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=example.marks) for name, example in sorted(EXAMPLES.items())],
)
def test_an_example_runs(name: str) -> None:
    example = EXAMPLES[name]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=example.timeout_s,
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
