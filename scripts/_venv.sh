# Sourced by scripts/demo and scripts/test: one virtual environment (.venv, or $KVGATE_VENV) for both, so
# that the demo's install is the tests' too and nothing (torch above all) is installed twice.
# The caller sets SCRIPT (its name, for messages) and STEPS (how many steps it announces).

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV="${KVGATE_VENV:-.venv}"
PY="$VENV/bin/python"
# torch is pinned here, not in the package (which asks for a range): on these machines 2.13.0 (a CPU build) is
# on disk and installs in seconds, whereas an unpinned torch would pull a multi-GB CUDA build.
TORCH="${KVGATE_TORCH:-torch==2.13.0}"
PIP_LOG="$VENV/pip.log"
START_S=$SECONDS
STEP=0

say() { echo "$SCRIPT: $*" >&2; }

# "scripts/test: [2/5] installing ... (12 s)": each step as it starts, with the seconds since the script did.
step() {
  STEP=$((STEP + 1))
  say "[$STEP/$STEPS] $* ($((SECONDS - START_S)) s)"
}

ensure_venv() {
  if [ -x "$PY" ] && "$PY" -m pip --version >/dev/null 2>&1; then
    step "using $VENV ($("$PY" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])'))"
    return
  fi
  step "creating $VENV with $("$PYTHON" --version 2>&1)"
  # --clear: a venv left half made (Debian without python3-venv writes bin/python, then fails) is redone.
  if ! "$PYTHON" -m venv --clear "$VENV" >"${TMPDIR:-/tmp}/kvgate-venv.log" 2>&1; then
    say "could not create $VENV with $PYTHON (log: ${TMPDIR:-/tmp}/kvgate-venv.log); on Debian/Ubuntu: sudo apt install python3-venv"
    exit 1
  fi
}

# pip with a line per package it collects, builds and installs on the screen; its whole output goes to
# $PIP_LOG, whose end is shown if it fails.
pip_install() {
  local rc
  set +e
  PYTHONUNBUFFERED=1 "$PY" -m pip install --progress-bar off "$@" </dev/null 2>&1 | tee "$PIP_LOG" \
    | { grep --line-buffered -E '^(Collecting|Processing|Building|Installing|Successfully)' \
        | sed -u -E -e 's/ \(from [^)]*\)$//' -e 's|^Processing [^ ]*/([^-/ ]+-[^-/ ]+)-[^ ]*\.whl|Collecting \1|' \
          -e 's/^/    /' >&2; true; }
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" != 0 ]; then
    tail -n 25 "$PIP_LOG" >&2
    say "pip failed (its whole output: $PIP_LOG)"
    exit "$rc"
  fi
}

ensure_torch() {
  local have
  if have=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    step "torch $have is already in $VENV"
  else
    step "installing $TORCH into $VENV (the CPU build on these machines; seconds) ..."
    pip_install "$TORCH"
  fi
}

# kvgate itself, editable (an edit to the code needs no reinstall), with an extra: engine for the demo, dev
# (engine's plus the tests') for scripts/test. A stamp in the venv remembers what was installed from which
# pyproject.toml, so that a second run of either script, or the demo after the tests, installs nothing.
STAMP="$VENV/.kvgate-installed"
stamp_of() { cat pyproject.toml engine/compress/_rans.c 2>/dev/null | cksum | cut -d' ' -f1; }
installed_with() {  # installed_with EXTRA: true if kvgate is installed here with EXTRA (dev includes engine)
  [ -f "$STAMP" ] || return 1
  local extra sum
  read -r extra sum <"$STAMP"
  [ "$sum" = "$(stamp_of)" ] && { [ "$extra" = "$1" ] || [ "$extra" = dev ]; }
}
ensure_kvgate() {  # ensure_kvgate EXTRA WHAT
  if installed_with "$1"; then
    step "kvgate and $2 are already installed in $VENV"
    return
  fi
  step "installing kvgate and $2 into $VENV ..."
  pip_install -e ".[$1]"
  echo "$1 $(stamp_of)" >"$STAMP"
}
