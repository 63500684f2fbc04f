#!/usr/bin/env bash
# weave's two everyday commands, usable on a fresh Debian/Ubuntu machine:
#   bash cmake/dev.sh demo   build and run the main demo
#   bash cmake/dev.sh test   build everything and run the test suite
# Both first install what is missing (as root, through apt-get) or say what to install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

packages=(cmake g++ ninja-build libopenmpi-dev openmpi-bin doctest-dev libbenchmark-dev)
demo_target=moe_demo

missing_packages() {
  local missing=()
  for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  echo "${missing[@]:-}"
}

ensure_dependencies() {
  if ! command -v dpkg-query >/dev/null 2>&1; then
    for tool in cmake c++ ninja; do
      command -v "$tool" >/dev/null 2>&1 || {
        echo "weave: '$tool' not found. Install CMake >= 3.25, a C++20 compiler, Ninja, doctest," \
             "Google Benchmark and (optionally) Open MPI with your package manager." >&2
        exit 1
      }
    done
    return
  fi
  local missing
  missing=$(missing_packages)
  if [[ -n "$missing" ]]; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
      echo "weave: installing missing packages: $missing"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      # shellcheck disable=SC2086
      apt-get install -y -qq --no-install-recommends $missing >/dev/null
    else
      echo "weave: missing packages: $missing" >&2
      echo "weave: install them with: sudo apt-get install $missing" >&2
      exit 1
    fi
  fi
  local version
  version=$(cmake --version | head -n1 | sed 's/[^0-9]*\([0-9]*\.[0-9]*\).*/\1/')
  if [[ $(printf '%s\n3.25\n' "$version" | sort -V | head -n1) != "3.25" ]]; then
    echo "weave: CMake $version is too old; weave needs CMake >= 3.25" >&2
    exit 1
  fi
}

# Open MPI refuses to run as root unless told (containers and CI run as root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

case "${1:-}" in
  demo)
    ensure_dependencies
    cmake --preset default
    cmake --build --preset default --target "$demo_target"
    "./build/default/examples/$demo_target" "${@:2}"
    ;;
  test)
    # The test suite also builds the API reference (doxygen) and runs the libtorch trainer
    # example (examples/torch); both are skipped where they are not installed.
    packages+=(doxygen libtorch-dev)
    ensure_dependencies
    cmake --workflow --preset test
    ;;
  *)
    echo "usage: bash cmake/dev.sh demo|test" >&2
    exit 2
    ;;
esac
