#!/usr/bin/env bash
# The plain-install check: what a user gets from `pip install torch==2.13.0 ftstate`.
#
# Builds the wheel, installs it with ONLY its declared dependencies (no extras) plus torch's
# CPU build into a fresh virtual environment outside the checkout, and from a folder that is
# not the checkout runs what a new user runs first:
#   names    every name of ftstate.__all__ (plain_install_smoke.py names)
#   sync     a real Runtime on a local Ray cluster, fault tolerance off and on; every rollout
#            holds the trainer's weights (plain_install_smoke.py sync)
#   demo     `ftstate demo --steps 4`: exits 0 and writes report.json (without matplotlib the
#            picture is skipped, and report.json says so)
#   audit    `ftstate audit --check` of the demo's trail passes; `--plot` without matplotlib
#            is one line naming the extra, exit 2, no traceback
#   diagram  `ftstate diagram`
#   config   `ftstate config` prints a config that `ftstate config FILE` accepts
# Each check fails on a non-zero exit, on a Python traceback, or on a warning printed through
# Python's warnings module (e.g. torch's "Failed to initialize NumPy"), also from Ray workers.
#
# Environment: PY (python for the new venv, default python3), PIP (pip that builds the wheel,
# default .venv/bin/pip), TORCH (default torch==2.13.0), KEEP=1 keeps the temp folder.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PY:-python3}"
PIP="${PIP:-$REPO/.venv/bin/pip}"
TORCH="${TORCH:-torch==2.13.0}"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP VIRTUAL_ENV

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ftstate-install-check.XXXXXX")"
cleanup() {
    if [[ "${KEEP:-0}" == 1 ]]; then echo "install-check: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
case "$WORK/" in "$REPO"/*) echo "install-check: FAIL temp folder $WORK is inside the checkout"; exit 1 ;; esac

T0=$SECONDS
FAILED=()

say() { echo "install-check: $*"; }

# A Python warning as the warnings module prints it ("file.py:12: UserWarning: ..."), Ray's
# copy of a worker's ("(WorkerHost pid=1) file.py:12: ..."), or a traceback.
PROBLEMS='\.py:[0-9]+: [A-Za-z]*Warning: |Traceback \(most recent call last\)|Failed to initialize NumPy'

# run_check NAME EXPECTED_RC TIMEOUT_S CMD...: run in $WORK, output to $WORK/logs/NAME.{out,err}.
run_check() {
    local name="$1" want="$2" limit="$3"
    shift 3
    local out="$WORK/logs/$name.out" err="$WORK/logs/$name.err" rc=0 t=$SECONDS why=""
    (cd "$WORK" && timeout --kill-after=10 "$limit" "$@") >"$out" 2>"$err" || rc=$?
    if [[ $rc == 124 || $rc == 137 ]]; then
        why="timed out after ${limit}s"
    elif [[ $rc != "$want" ]]; then
        why="exit status $rc, expected $want"
    elif grep -qE "$PROBLEMS" "$out" "$err"; then
        why="printed a Python warning or traceback"
    fi
    if [[ -z "$why" ]] && declare -F "post_$name" >/dev/null; then
        why="$("post_$name" "$out" "$err")" || true
    fi
    if [[ -n "$why" ]]; then
        say "FAIL $name ($((SECONDS - t))s): $why"
        echo "---- $name: stdout (last 40 lines)"
        tail -n 40 "$out"
        echo "---- $name: stderr (problem lines, then the last 40 lines)"
        grep -nE "$PROBLEMS" "$err" "$out" | head -n 20 || true
        tail -n 40 "$err"
        echo "----"
        FAILED+=("$name")
    else
        say "PASS $name ($((SECONDS - t))s)"
    fi
}

# -- post-checks: print why a check failed, nothing when it passed --------------------------

post_demo() {
    local report="$WORK/demo/report.json"
    [[ -f "$report" ]] || { echo "no $report written"; return; }
    "$WORK/venv/bin/python" - "$report" 2>&1 <<'EOF' || echo " (cannot read $report)"
import json, sys
r = json.load(open(sys.argv[1]))
problems = []
if r["error"] or r["steps_done"] != r["steps"]:
    problems.append(f"ran {r['steps_done']}/{r['steps']} steps, error {r['error']}")
if not r["identical_to_fault_free"]:
    problems.append("not identical to the fault-free run")
if r.get("timeline_picture") is None and "ftstate[plot]" not in (r.get("timeline_picture_skipped") or ""):
    problems.append(f"picture neither drawn nor skipped naming the plot extra: {r.get('timeline_picture_skipped')}")
print("; ".join(problems), end="")
EOF
}

post_audit_plot() {
    local err="$2"
    if [[ "$(grep -c . "$err")" != 1 ]] || ! grep -q "pip install 'ftstate\[plot\]'" "$err"; then
        echo "expected one stderr line naming pip install 'ftstate[plot]', got: $(head -c 400 "$err")"
    fi
}

post_diagram() { grep -q "stateDiagram-v2" "$1" || echo "no mermaid diagram printed"; }

post_config() {
    cp "$1" "$WORK/ftstate.yaml"
    "$WORK/venv/bin/ftstate" config "$WORK/ftstate.yaml" >/dev/null 2>&1 || echo "its own default config is not valid"
}

# -- build and install ------------------------------------------------------------------

mkdir -p "$WORK/logs" "$WORK/dist"
say "building the wheel of $REPO"
if ! "$PIP" wheel --no-deps -q -w "$WORK/dist" "$REPO" >"$WORK/logs/wheel.log" 2>&1; then
    cat "$WORK/logs/wheel.log"; say "FAIL wheel: cannot build"; exit 1
fi
WHEEL="$(ls "$WORK"/dist/ftstate-*.whl)"
say "PASS wheel ($((SECONDS - T0))s): $(basename "$WHEEL")"

t=$SECONDS
"$PY" -m venv "$WORK/venv"
if ! "$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "$TORCH" "$WHEEL" \
        >"$WORK/logs/install.log" 2>&1; then
    cat "$WORK/logs/install.log"; say "FAIL install: $TORCH + the wheel, no extras"; exit 1
fi
# What this check is about: only declared dependencies, from outside the checkout.
if ! (cd "$WORK" && "$WORK/venv/bin/python" - "$REPO" <<'EOF'
import importlib.util, pathlib, sys
import ftstate
repo = pathlib.Path(sys.argv[1]).resolve()
assert not pathlib.Path(ftstate.__file__).resolve().is_relative_to(repo), f"ftstate imported from the checkout: {ftstate.__file__}"
assert not any(p and pathlib.Path(p).resolve() == repo for p in sys.path), f"the checkout is on sys.path: {sys.path}"
assert importlib.util.find_spec("matplotlib") is None, "matplotlib is installed: the extras leaked into the plain install"
EOF
); then
    say "FAIL install: not a plain install outside the checkout"; exit 1
fi
say "PASS install ($((SECONDS - t))s): $TORCH + $(basename "$WHEEL") into a fresh venv, no extras"

# -- what a user runs first -------------------------------------------------------------

cp "$REPO/tests/install/plain_install_smoke.py" "$WORK/"
export FTSTATE_CHECKOUT="$REPO"
V="$WORK/venv/bin"
run_check names 0 60 "$V/python" plain_install_smoke.py names
run_check sync 0 400 "$V/python" plain_install_smoke.py sync
run_check demo 0 400 "$V/ftstate" demo --steps 4 --batch-size 16 --pad-mb 1 --no-live --out "$WORK/demo"
run_check audit_check 0 60 "$V/ftstate" audit "$WORK/demo/audit.jsonl" --check --no-timeline
run_check audit_plot 2 60 "$V/ftstate" audit "$WORK/demo/audit.jsonl" --plot "$WORK/timeline.png"
run_check diagram 0 60 "$V/ftstate" diagram
run_check config 0 60 "$V/ftstate" config

if ((${#FAILED[@]})); then
    say "FAIL: ${#FAILED[@]} check(s) failed (${FAILED[*]}) in $((SECONDS - T0))s"
    exit 1
fi
say "PASS: the plain install works (wheel, install, names, sync, demo, audit, diagram, config) in $((SECONDS - T0))s"
