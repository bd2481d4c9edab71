#!/usr/bin/env bash
# test_as_user.sh [USER]: the suite once more as a user who is not root (default
# mpifusion-test, created when missing), so no test quietly needs root, root's home or
# root's files. Run as root (CI does, after scripts/test.sh). The user gets a copy of the
# tracked tree in their home and a venv of the system's python3 (a Python installed under
# /root, such as pyenv's, is not theirs to run); the run is scripts/test.sh with MPICH at 2
# ranks and the serial tests, without the frameworks (the root run covers those), and
# without Slurm (its cluster needs root): 3-4 minutes on 2 cores. Its exit status is theirs.
set -euo pipefail
cd "$(dirname "$0")/.."
user=${1:-mpifusion-test}
if [ "$(id -u)" != 0 ]; then
  echo "test_as_user.sh: run as root (it creates and switches to another user)" >&2
  exit 2
fi
id "$user" >/dev/null 2>&1 || useradd --create-home "$user"
home=$(getent passwd "$user" | cut -d: -f6)
dest=$home/mpifusion
rm -rf "$dest"
runuser -u "$user" -- mkdir -p "$dest"
git ls-files -z | tar --null -T - -c | runuser -u "$user" -- tar -x -C "$dest"
echo "=== the suite as $user (uid $(id -u "$user")) in $dest"
cd /
exec runuser -u "$user" -- env -i HOME="$home" USER="$user" LOGNAME="$user" \
  PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
  MPIFUSION_TEST_EXTRAS="" MPIFUSION_TEST_RANKS="${MPIFUSION_USER_TEST_RANKS:-2}" \
  bash -c 'cd "$1" && scripts/test.sh' test_as_user.sh "$dest"
