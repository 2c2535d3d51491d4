# Shared by the set-up scripts (sourced): a virtual environment whose installs rerun only when
# its recipe changes.

# venv_needs_install VENV PYTHON RECIPE_FILE...: creates VENV with PYTHON if it is missing;
# succeeds when the recipe files changed since the last complete install (call venv_installed
# VENV after installing).
venv_needs_install() {
    local venv="$1" python="$2"
    shift 2
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    _venv_recipe="$(cat "$@" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
    [ ! -f "$venv/.rollout_sync_installed" ] \
        || [ "$(cat "$venv/.rollout_sync_installed")" != "$_venv_recipe" ]
}

venv_installed() {
    echo "$_venv_recipe" > "$1/.rollout_sync_installed"
}

# quiet_pip ARGS: $venv's pip. This machine's pip config points at optional local indexes;
# hide that noise.
quiet_pip() {
    "$venv/bin/pip" "$@" 2> >(grep -v "^WARNING: Location" >&2)
}
