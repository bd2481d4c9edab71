#!/usr/bin/env bash
# The whole test suite, set-up included: installs mpifusion with an MPI from the package
# registry and the test tools, runs the MPI tests under mpiexec at 1, 2, 3, 4 and 8 ranks,
# then the serial tests. Extra arguments go to every pytest run (e.g. -k layout, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# Open MPI refuses root and oversubscription unless told; MPICH ignores these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
PYTHON=${PYTHON:-python3}
# torch (CPU build, pinned), jax and paddle (CPU) let the framework and Paddle-parity tests run;
# MPIFUSION_TEST_EXTRAS="" skips them (those tests are then skipped, not failed).
EXTRAS=${MPIFUSION_TEST_EXTRAS-torch,jax,paddle}
if [ -z "${MPIFUSION_NO_INSTALL:-}" ]; then
  "$PYTHON" -m pip install -q -e ".[mpi,test${EXTRAS:+,$EXTRAS}]"
fi
MPIEXEC=${MPIEXEC:-mpiexec}
for n in ${MPIFUSION_TEST_RANKS:-1 2 3 4 8}; do
  echo "=== MPI tests at $n rank(s)"
  # python -m mpi4py: an uncaught error on one rank aborts every rank instead of hanging.
  timeout --signal=KILL 1200 "$MPIEXEC" -n "$n" "$PYTHON" -m mpi4py -m pytest --only-mpi -q "$@" tests
done
echo "=== serial tests"
"$PYTHON" -m pytest -q "$@" tests
