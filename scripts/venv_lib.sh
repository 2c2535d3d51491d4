# Shared by the set-up scripts (sourced): a virtual environment whose installs rerun only when
# its recipe changes, and set-up steps that say what they are doing (on stderr, so a --json
# stdout stays clean). A run with nothing to set up prints nothing.

# venv_needs_install VENV PYTHON ABOUT RECIPE_FILE...: succeeds when VENV needs its installs:
# never completed, or its recipe files changed since the last complete install (call
# venv_installed VENV after installing, then setup_finish). Then it also announces the set-up
# (ABOUT: what it installs and how long a first set-up takes) and creates VENV with PYTHON if
# it is missing, as the first step. Silent when VENV is up to date.
venv_needs_install() {
    local venv="$1" python="$2" about="$3" name
    shift 3
    name="$(basename "$venv")"
    _venv_recipe="$(cat "$@" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
    if [ -x "$venv/bin/python" ] && [ -f "$venv/.rollout_sync_installed" ] \
        && [ "$(cat "$venv/.rollout_sync_installed")" = "$_venv_recipe" ]; then
        return 1
    fi
    _setup_venv="$venv"
    _setup_name="$name"
    if [ -f "$venv/.rollout_sync_installed" ]; then
        _setup_intro="updating $name: its recipe (pyproject.toml or scripts/) changed;"
        _setup_intro+=" unchanged steps take seconds"
    elif [ -x "$venv/bin/python" ]; then
        _setup_intro="setting up $name again, as its last set-up did not finish ($about;"
        _setup_intro+=" finished steps take seconds)"
    else
        _setup_intro="first run: setting up $name ($about); later runs skip this"
    fi
    # Until venv_installed: a set-up that stops part way (failed, interrupted) reruns in full.
    rm -f "$venv/.rollout_sync_installed"
    # Called as an `if` condition, where set -e does not apply: stop here by hand.
    if [ ! -x "$venv/bin/python" ]; then
        setup_step "creating $name ($python -m venv)" "$python" -m venv "$venv" || exit
    fi
}

venv_installed() {
    echo "$_venv_recipe" > "$1/.rollout_sync_installed"
}

# setup_step [--optional] DESCRIPTION COMMAND [ARGS...]: runs one set-up step as
#   [set-up] DESCRIPTION... done in 41 s
# on stderr (the first step of a run first prints the announcement of venv_needs_install). The
# command runs in a subshell; its output, stdout included, is held and shown on stderr after
# that line. When it fails: which step failed, its exit status and how to retry, and returns
# that status, so that under set -e the set-up stops there, before venv_installed (the next run
# redoes the set-up). --optional: the caller goes on without the step; no retry advice.
setup_step() {
    local optional="" what t0 out rc=0 retry
    if [ "$1" = --optional ]; then
        optional=1
        shift
    fi
    what="$1"
    shift
    if [ -z "${_setup_t0:-}" ]; then
        _setup_t0=$SECONDS
        if [ -n "${_setup_intro:-}" ]; then echo "[set-up] $_setup_intro" >&2; fi
    fi
    printf '[set-up] %s... ' "$what" >&2
    t0=$SECONDS
    out="$("$@" 2>&1)" || rc=$?
    if [ "$rc" = 0 ]; then
        echo "done in $(_setup_duration $((SECONDS - t0)))" >&2
        if [ -n "$out" ]; then printf '%s\n' "$out" >&2; fi
        return 0
    fi
    echo "FAILED after $(_setup_duration $((SECONDS - t0))) (exit status $rc)" >&2
    if [ -n "$out" ]; then printf '%s\n' "$out" >&2; fi
    if [ -z "$optional" ]; then
        out="${out:+the cause is in its output above}"
        out="${out:-it printed nothing}"
        echo "[set-up] Set-up failed at the step \"$what\": exit status $rc; $out." >&2
        retry="[set-up] To retry, fix the cause and run the same command again: set-up runs again,"
        retry+=" and the steps that finished take seconds."
        if [ -n "${_setup_venv:-}" ]; then retry+=" To start over instead: rm -rf $_setup_venv"; fi
        echo "$retry" >&2
    fi
    return "$rc"
}

# setup_finish: after the last step, the total, e.g. "[set-up] .venv is ready: set-up took
# 2 min 31 s". Prints nothing when no step ran.
setup_finish() {
    if [ -z "${_setup_t0:-}" ]; then return 0; fi
    local took
    took="$(_setup_duration $((SECONDS - _setup_t0)))"
    if [ -n "${_setup_name:-}" ]; then
        echo "[set-up] $_setup_name is ready: set-up took $took" >&2
    else
        echo "[set-up] done: set-up took $took" >&2
    fi
    unset _setup_t0 _setup_intro _setup_venv _setup_name
}

# _setup_duration SECONDS: "41 s", "2 min 31 s".
_setup_duration() {
    if [ "$1" -lt 60 ]; then echo "$1 s"; else echo "$(($1 / 60)) min $(($1 % 60)) s"; fi
}

# quiet_pip ARGS: $venv's pip. This machine's pip config points at optional local indexes;
# hide that noise.
quiet_pip() {
    "$venv/bin/pip" "$@" 2> >(grep -v "^WARNING: Location" >&2)
}
