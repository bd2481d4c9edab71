#!/usr/bin/env bash
# private_shm.sh COMMAND...: run COMMAND with a /dev/shm of its own, a fresh tmpfs in a
# private mount namespace. The MPI libraries keep their shared-memory segments there
# (MPICH's mpich_shm_*, Open MPI's sm_segment.*), so a test run sees exactly its own jobs'
# segments and never another job's, and what its killed jobs leave goes when it ends (each
# suite run used to leave ~65 in the machine's /dev/shm). Needs root and util-linux's unshare;
# elsewhere (a non-root user, a container without CAP_SYS_ADMIN) COMMAND runs with the
# machine's /dev/shm. Inside, MPIFUSION_PRIVATE_SHM=1, and a nested call just runs COMMAND.
# Used by scripts/test.sh and .ci/run (which starts the Slurm test cluster inside, so the
# batch jobs' segments land there too).
set -euo pipefail
if [ -n "${MPIFUSION_PRIVATE_SHM:-}" ] || [ "$(id -u)" != 0 ] ||
   ! command -v unshare >/dev/null || ! unshare --mount true 2>/dev/null; then
  exec "$@"
fi
exec unshare --mount --propagation private -- bash -c '
  if mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm; then
    export MPIFUSION_PRIVATE_SHM=1
  else
    echo "private_shm.sh: cannot mount a tmpfs on /dev/shm; using the machine'"'"'s" >&2
  fi
  exec "$@"' private_shm.sh "$@"
