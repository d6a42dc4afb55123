#!/usr/bin/env bash
# Install the real launchers tests/test_real_launchers.py runs under, from Debian's packages: SLURM
# (slurm-wlm, with munge), Open MPI (openmpi-bin) and MPICH (mpich: its mpiexec.hydra installs beside
# Open MPI's mpirun). Packages already installed are not fetched again, so a machine that has them
# spends about a second here; a fresh one about a minute.
# Without root or apt-get it installs nothing and says so: the tests then skip, naming what is missing.
set -euo pipefail

packages=(slurm-wlm munge openmpi-bin mpich)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "[launchers] installed already: ${packages[*]}"
  exit 0
fi
if ! command -v apt-get >/dev/null || [ "$(id -u)" -ne 0 ]; then
  echo "[launchers] cannot install ${missing[*]}: needs root and apt-get (the real-launcher tests will skip)"
  exit 0
fi
echo "[launchers] installing ${missing[*]} from Debian's packages"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" > /dev/null
