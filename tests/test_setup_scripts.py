"""The set-up scripts' progress lines (scripts/venv_lib.sh, sourced by scripts/setup_venv.sh and
scripts/setup_cosmos_venv.sh): a first run says each step and its time on stderr, a run with
nothing to set up prints nothing, and a failing step says which one failed and how to retry.
Plain bash in a subprocess; a stand-in for `python -m venv`, no pip."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "scripts" / "venv_lib.sh"
SECS = r"\d+ s"


def bash(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Runs SCRIPT under set -euo pipefail (as the set-up scripts do) after sourcing venv_lib.sh."""
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{LIB}"; {script}'],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def lines(text: str) -> list[str]:
    return text.splitlines()


def test_a_step_that_succeeds_says_what_it_did_and_how_long_on_stderr(tmp_path: Path) -> None:
    r = bash('setup_step "doing a thing" echo "from the step"; echo after', tmp_path)
    assert r.returncode == 0, r.stderr
    # The step's own stdout goes to stderr too: a --json stdout stays clean.
    assert r.stdout == "after\n"
    err = lines(r.stderr)
    assert re.fullmatch(rf"\[set-up\] doing a thing\.\.\. done in {SECS}", err[0]), err
    assert err[1:] == ["from the step"]


def test_a_failing_step_says_which_step_its_status_and_how_to_retry_and_stops_the_script(
    tmp_path: Path,
) -> None:
    r = bash(
        "_setup_venv=/somewhere/.venv; "
        "setup_step \"breaking a thing\" bash -c 'echo boom >&2; exit 3'; echo after",
        tmp_path,
    )
    assert r.returncode == 3  # set -e stops the script with the step's status
    assert r.stdout == ""  # nothing after the failing step ran
    err = lines(r.stderr)
    assert re.fullmatch(
        rf"\[set-up\] breaking a thing\.\.\. FAILED after {SECS} \(exit status 3\)", err[0]
    ), err
    assert err[1] == "boom"  # the command's output, shown after its step
    assert err[2] == (
        '[set-up] Set-up failed at the step "breaking a thing": exit status 3; '
        "the cause is in its output above."
    )
    assert err[3].startswith("[set-up] To retry, fix the cause and run the same command again")
    assert err[3].endswith("To start over instead: rm -rf /somewhere/.venv")
    assert len(err) == 4


def test_an_optional_step_that_fails_lets_the_caller_go_on_without_retry_advice(
    tmp_path: Path,
) -> None:
    r = bash('setup_step --optional "an extra" false || echo "went on"', tmp_path)
    assert r.returncode == 0
    assert r.stdout == "went on\n"
    err = lines(r.stderr)
    assert re.fullmatch(rf"\[set-up\] an extra\.\.\. FAILED after {SECS} \(exit status 1\)", err[0])
    assert len(err) == 1


def test_durations(tmp_path: Path) -> None:
    r = bash("_setup_duration 0; _setup_duration 41; _setup_duration 151", tmp_path)
    assert lines(r.stdout) == ["0 s", "41 s", "2 min 31 s"]


# A stand-in for `python -m venv DIR`: makes DIR/bin/python.
FAKE_PYTHON = (
    '#!/usr/bin/env bash\nmkdir -p "$3/bin" && touch "$3/bin/python" && chmod +x "$3/bin/python"\n'
)


def set_up(tmp_path: Path, step: str = "true") -> subprocess.CompletedProcess[str]:
    """What scripts/setup_venv.sh does, with one step running STEP."""
    return bash(
        f'if venv_needs_install "{tmp_path}/env" "{tmp_path}/python" "a thing, about a minute" '
        f'"{tmp_path}/recipe"; then\n'
        f'    setup_step "installing a thing" {step}\n'
        f'    venv_installed "{tmp_path}/env"\n'
        "fi\n"
        "setup_finish",
        tmp_path,
    )


def test_first_run_announces_each_step_and_the_total_and_later_runs_print_nothing(
    tmp_path: Path,
) -> None:
    (tmp_path / "python").write_text(FAKE_PYTHON)
    (tmp_path / "python").chmod(0o755)
    (tmp_path / "recipe").write_text("v1\n")

    first = set_up(tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout == ""
    err = lines(first.stderr)
    assert (
        err[0]
        == "[set-up] first run: setting up env (a thing, about a minute); later runs skip this"
    )
    python = re.escape(str(tmp_path / "python"))
    assert re.fullmatch(
        rf"\[set-up\] creating env \({python} -m venv\)\.\.\. done in {SECS}", err[1]
    )
    assert re.fullmatch(rf"\[set-up\] installing a thing\.\.\. done in {SECS}", err[2]), err
    assert re.fullmatch(rf"\[set-up\] env is ready: set-up took {SECS}", err[3]), err
    assert len(err) == 4

    again = set_up(tmp_path)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")

    (tmp_path / "recipe").write_text("v2\n")
    changed = set_up(tmp_path)
    assert changed.returncode == 0, changed.stderr
    err = lines(changed.stderr)
    assert err[0].startswith("[set-up] updating env: its recipe")
    assert err[1].startswith(
        "[set-up] installing a thing... done in"
    )  # the env exists: no creating
    assert len(err) == 3


def test_a_failed_set_up_leaves_no_stamp_and_the_next_run_does_it_again(tmp_path: Path) -> None:
    (tmp_path / "python").write_text(FAKE_PYTHON)
    (tmp_path / "python").chmod(0o755)
    (tmp_path / "recipe").write_text("v1\n")

    failed = set_up(tmp_path, step="false")
    assert failed.returncode == 1
    assert not (tmp_path / "env" / ".rollout_sync_installed").exists()
    err = lines(failed.stderr)
    assert err[-2] == (
        '[set-up] Set-up failed at the step "installing a thing": exit status 1; '
        "it printed nothing."
    )
    assert err[-1].endswith(f"To start over instead: rm -rf {tmp_path}/env")
    assert not any("is ready" in line for line in err)

    retried = set_up(tmp_path)
    assert retried.returncode == 0, retried.stderr
    err = lines(retried.stderr)
    assert err[0].startswith("[set-up] setting up env again, as its last set-up did not finish")
    assert err[1].startswith("[set-up] installing a thing... done in")
    assert (tmp_path / "env" / ".rollout_sync_installed").exists()
    assert set_up(tmp_path).stderr == ""


def test_a_failed_update_drops_the_old_stamp(tmp_path: Path) -> None:
    """Else going back to the old recipe would skip a half-updated env."""
    (tmp_path / "python").write_text(FAKE_PYTHON)
    (tmp_path / "python").chmod(0o755)
    (tmp_path / "recipe").write_text("v1\n")
    assert set_up(tmp_path).returncode == 0
    (tmp_path / "recipe").write_text("v2\n")
    assert set_up(tmp_path, step="false").returncode == 1
    (tmp_path / "recipe").write_text("v1\n")
    back = set_up(tmp_path)
    assert back.returncode == 0, back.stderr
    assert lines(back.stderr)[0].startswith("[set-up] setting up env again, as its last set-up")
