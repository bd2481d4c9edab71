#!/usr/bin/env bash
# python_lane.sh [VERSION...]: the Python versions the README claims, tested. The README and
# setup.cfg say "Python 3.9+" (python_requires = >=3.9), but scripts/test.sh runs the suite on
# one Python only (CI: the image's python3, 3.11), so a module that needs a newer Python than
# the lowest claimed, or a dependency without a release for the newest, went unnoticed. This
# lane takes the lowest and the highest claimed version (default: the lowest from
# python_requires; the highest from setup.cfg's "Programming Language :: Python :: 3.N"
# classifiers, else the newest 3.x that pyenv has, 3.13 on the CI image; or the versions
# given, e.g. `scripts/python_lane.sh 3.9 3.12`), and for each, with pyenv's Python
# ($PYENV_ROOT/versions/<version>.*, a missing one fails the lane):
#   install   a fresh venv in a temp folder and `pip install -e ".[mpi,test]"` (no frameworks:
#             the lane is about the core), the versions' installs side by side
#   imports   every file byte-compiled with warnings as errors (a syntax of a newer Python, an
#             escape that a newer one refuses), every mpifusion module imported, and the C
#             kernel (mpifusion.arrays._halfcast) built against that Python
#   quickstart the README's quick start command: mpiexec -n 8 mpifusion run (ends with PASS)
#   serial    a fast part of the serial tests (plan, arrays, the oracle's check, the CLI's
#             layout/info/tune files, a bf16/fp32 `mpifusion run`; not the slow fuzzers)
#   mpi-n2    the core buffer tests under the venv's mpiexec at 2 ranks
# with strict skips (tests/skips.py; only the frameworks this lane leaves out may skip). It
# works on a copy of the tree (the files git knows, committed or not): the editable install
# writes mpifusion.egg-info, build/ and the kernel's .so into the tree it installs from, and
# must not do that under a run of the suite using this checkout. Everything goes at the end;
# the exit status is 1 when any phase failed; each phase's time is printed. About 3 minutes for
# both versions on a busy 2-core machine, a third of it pip (an empty pip cache).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# The run's own /dev/shm where the machine allows it (root: scripts/private_shm.sh).
if [ -z "${MPIFUSION_SHM_CHECKED:-}" ]; then
  export MPIFUSION_SHM_CHECKED=1
  exec scripts/private_shm.sh "$ROOT/scripts/python_lane.sh" "$@"
fi
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONDONTWRITEBYTECODE
BASE_PATH=$PATH
PYENV_ROOT=${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")}
die() { echo "scripts/python_lane.sh: $*" >&2; exit 1; }

# --- which versions ---
if [ $# -gt 0 ]; then
  VERSIONS=("$@")
  echo "=== versions: $* (given)"
else
  low=$(sed -n 's/^python_requires *= *>= *\(3\.[0-9][0-9]*\).*/\1/p' setup.cfg)
  [ -n "$low" ] || die "no 'python_requires = >=3.N' in setup.cfg; give the versions: $0 3.9 3.13"
  high=$(sed -n 's/^ *Programming Language :: Python :: \(3\.[0-9][0-9]*\) *$/\1/p' setup.cfg |
    sort -t. -k2,2n | tail -n 1)
  from="setup.cfg's classifiers"
  if [ -z "$high" ]; then
    from="the newest Python 3 under $PYENV_ROOT/versions (setup.cfg names no newest)"
    high=$(ls "$PYENV_ROOT/versions" 2>/dev/null | grep -E '^3\.[0-9]+\.[0-9]+$' |
      sort -t. -k2,2n | tail -n 1 | cut -d. -f1,2) || true
    [ -n "$high" ] || die "no Python 3 under $PYENV_ROOT/versions: this lane needs pyenv's" \
      "Pythons (pyenv install $low; PYENV_ROOT names another pyenv)"
  fi
  VERSIONS=("$low")
  [ "$high" = "$low" ] || VERSIONS+=("$high")
  echo "=== versions: $low (setup.cfg's python_requires) and $high ($from)"
fi
declare -A PY
for v in "${VERSIONS[@]}"; do
  # the newest patch release of that version (3.9 -> 3.9.18), not a -dev or free-threaded one
  patch=$(ls "$PYENV_ROOT/versions" 2>/dev/null | grep -E "^${v//./\\.}\.[0-9]+$" |
    sort -t. -k3,3n | tail -n 1) || true
  [ -n "$patch" ] && [ -x "$PYENV_ROOT/versions/$patch/bin/python" ] ||
    die "no Python $v under $PYENV_ROOT/versions: this lane needs pyenv's Python $v" \
      "(pyenv install $v; PYENV_ROOT names another pyenv)"
  PY[$v]=$PYENV_ROOT/versions/$patch/bin/python
done

# --- the run's folder, cleaned up whatever the outcome ---
TMP=$(mktemp -d "${TMPDIR:-/tmp}/mpifusion-pylane.XXXXXX")
export MPIFUSION_TEST_RUN=pylane-${TMP##*.}   # every process of the lane carries it
python3 tests/leftovers.py snapshot "$TMP/before.json"
declare -A INSTALL_PID
TIMES=()
FAILED=()
START=$SECONDS
finish() {
  local rc=$? v
  cd "$ROOT"
  export PATH=$BASE_PATH
  for v in "${!INSTALL_PID[@]}"; do  # stopped early: end the installs still running
    if kill -0 "${INSTALL_PID[$v]}" 2>/dev/null; then
      pkill -KILL -P "${INSTALL_PID[$v]}" 2>/dev/null || true
      kill -KILL "${INSTALL_PID[$v]}" 2>/dev/null || true
    fi
  done
  echo "=== times"
  printf '%s\n' "${TIMES[@]+"${TIMES[@]}"}"
  printf '%-22s %4d s\n' total $((SECONDS - START))
  python3 tests/leftovers.py check "$TMP/before.json" --token "$MPIFUSION_TEST_RUN" ||
    FAILED+=("leftover check")
  rm -rf "$TMP"
  if [ ${#FAILED[@]} -gt 0 ]; then
    echo "scripts/python_lane.sh: FAILED: ${FAILED[*]}" >&2
    [ "$rc" != 0 ] || rc=1
  fi
  exit "$rc"
}
trap finish EXIT

# --- a copy of the tree: what git knows (tracked files still present, untracked ones it does
# not ignore), or, outside a git checkout, everything but venvs and build outputs ---
SRC=$TMP/src
mkdir "$SRC"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z -co --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -C "$SRC" -xf -
else
  tar --exclude=./.git --exclude='./.venv*' --exclude=./build --exclude='*.egg-info' \
    --exclude='*.so' --exclude='__pycache__' -cf - . | tar -C "$SRC" -xf -
fi

# --- install: every version's venv at once (mostly downloads), each version's checks as soon
# as its own install is done ---
install_one() {  # install_one VERSION: venv + pip install -e, its times into $TMP/times-VERSION
  local v=$1 venv=$TMP/venv-$1 t=$SECONDS
  "${PY[$v]}" -m venv "$venv" || return 1
  printf '%-22s %4d s\n' "$v venv" $((SECONDS - t)) >>"$TMP/times-$v"
  t=$SECONDS
  # --no-compile: the .pyc of what is imported are written on first use, not all of numpy's
  # and hypothesis' at install (a third of the install's time here)
  (cd "$SRC" && "$venv/bin/python" -m pip install -q --no-compile -e ".[mpi,test]") || return 1
  printf '%-22s %4d s\n' "$v install" $((SECONDS - t)) >>"$TMP/times-$v"
}
for v in "${VERSIONS[@]}"; do
  echo "=== $v: installing mpifusion[mpi,test] into a fresh venv of ${PY[$v]} (in the background)"
  install_one "$v" >"$TMP/install-$v.log" 2>&1 &
  INSTALL_PID[$v]=$!
done

phase() {  # phase LABEL COMMAND...: run it, keep its time and outcome
  local label=$1 t=$SECONDS rc=0
  shift
  echo "=== $label"
  "$@" || rc=$?
  TIMES+=("$(printf '%-22s %4d s' "$label" $((SECONDS - t)))$([ "$rc" = 0 ] || echo " (exit $rc)")")
  [ "$rc" = 0 ] || FAILED+=("$label")
}
imports() {  # byte-compile everything, import every mpifusion module, the kernel built
  # (phase runs it after `||`, where set -e does not stop it: every step returns on failure)
  python -W error -m compileall -q mpifusion tests scripts benchmarks examples setup.py ||
    return 1
  python - <<'EOF'
import importlib, pkgutil, sys
import mpifusion
names = [m.name for m in pkgutil.walk_packages(mpifusion.__path__, "mpifusion.")
         if not m.name.endswith(".__main__")]   # __main__: what `python -m` runs
for name in names:
    importlib.import_module(name)
# The kernel is an optional extension (the install succeeds without it): here it must build.
import mpifusion.arrays._halfcast
print(f"imports: {len(names)} mpifusion modules; the C kernel built for Python "
      f"{sys.version.split()[0]}")
EOF
}
quickstart() {  # the README's quick start command; it ends with a PASS line
  timeout --signal=KILL 300 mpiexec -n 8 mpifusion run >"$TMP/quickstart.log" 2>&1 || {
    cat "$TMP/quickstart.log"; return 1; }
  tail -n 1 "$TMP/quickstart.log"
  grep -q '^PASS' "$TMP/quickstart.log"
}
# Strict skips: only the frameworks (torch, jax, paddle, megatron, matplotlib) may skip.
export MPIFUSION_STRICT_SKIPS=1 MPIFUSION_ALLOW_SKIPS=frameworks
SERIAL_TESTS=(tests/plan tests/arrays tests/oracle/test_oracle_check.py
  tests/oracle/test_error_bound.py tests/oracle/test_dump_files.py
  tests/oracle/test_exact_reference.py tests/tools/test_cli_layout.py
  tests/tools/test_cli_info.py tests/tools/test_tune_file.py
  tests/tools/test_cli_run.py::test_mixed_dtype_spec_passes)
MPI_TESTS=(tests/buffer/test_buffer.py)

for v in "${VERSIONS[@]}"; do
  rc=0
  wait "${INSTALL_PID[$v]}" || rc=$?
  unset "INSTALL_PID[$v]"
  echo "=== $v: install"
  cat "$TMP/install-$v.log"
  [ ! -f "$TMP/times-$v" ] || while IFS= read -r line; do TIMES+=("$line"); done <"$TMP/times-$v"
  if [ "$rc" != 0 ]; then
    TIMES+=("$(printf '%-22s' "$v install") (exit $rc)")
    FAILED+=("$v install")
    echo "=== $v: the install failed (above): no checks for it" >&2
    continue
  fi
  # the venv's python, pip and mpiexec (the mpich wheel's) first; each module compiled once,
  # into the lane's folder
  export PATH="$TMP/venv-$v/bin:$BASE_PATH" PYTHONPYCACHEPREFIX=$TMP/pycache-$v
  cd "$SRC"
  python - <<'EOF' || FAILED+=("$v versions")
import sys, importlib.metadata as m
from mpi4py import MPI
lib = MPI.Get_library_version().splitlines()[0].strip()
print(f"=== Python {sys.version.split()[0]}: " + ", ".join(
    f"{p} {m.version(p)}" for p in ("numpy", "ml_dtypes", "mpi4py", "mpich")) + f" ({lib})")
EOF
  phase "$v imports" imports
  phase "$v quickstart" quickstart
  phase "$v serial" timeout --signal=KILL 600 python -m pytest -q -k "not fuzz" \
    "${SERIAL_TESTS[@]}"
  phase "$v mpi-n2" timeout --signal=KILL 300 mpiexec -n 2 python -m mpi4py -m pytest \
    --only-mpi -q "${MPI_TESTS[@]}"
  cd "$ROOT"
  export PATH=$BASE_PATH
  unset PYTHONPYCACHEPREFIX
done
