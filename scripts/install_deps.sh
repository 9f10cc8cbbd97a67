#!/usr/bin/env bash
# Installs what SparsePrefill's builds need on a fresh Debian/Ubuntu machine, saying what it does before it does it:
#   - system packages (apt-get, outside this folder): cmake, ninja, g++, GoogleTest, python3-venv, and the Python
#     headers where they are missing (python3-dev): only the missing ones, only as root;
#   - the CUTLASS/CuTe headers, where nvcc is found: `pip download` of the wheel nvidia-cutlass==4.2.0.0 (6.4 MB, no
#     dependencies, nothing installed into any Python), its headers unpacked into .deps/cutlass of this tree, where
#     the plain CMake builds (scripts/demo.sh, scripts/build.sh) and scripts/test.sh's re-runs find them.
# Nothing is installed into the system Python: scripts/test.sh installs the package and the test tools into its own
# virtual environment (build/venv), and `pip install .` fetches its build requirements itself.
# Idempotent: each step is skipped when already satisfied. The CUDA toolkit (nvcc) is optional and not installed
# here; when present, the CUDA backend is compiled too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "[deps] $*"; }

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
# scripts/test.sh installs the package into a fresh virtual environment (Debian's python3 needs python3-venv for that)
"$PY" -c "import ensurepip, venv" 2>/dev/null || need_apt+=(python3-venv)
# the Python extension compiles against Python.h
"$PY" -c "import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
  2>/dev/null || need_apt+=(python3-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    say "installing system packages with apt-get (outside this folder, into the system): ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}" 2>&1 |
      { grep --line-buffered -E '^(Unpacking|Setting up) ' || true; } | sed -u 's/^/[deps]   apt: /'
  else
    say "missing system packages: ${need_apt[*]} (install them with your package manager, as root)" >&2
    exit 1
  fi
fi

# CUTLASS/CuTe headers for CUDA builds that do not go through `pip install .` (which fetches them itself)
CUTLASS_WHEEL="nvidia-cutlass==4.2.0.0"
if command -v nvcc >/dev/null && [ ! -d .deps/cutlass/include/cute ]; then
  say "CUTLASS/CuTe headers: pip download $CUTLASS_WHEEL (6.4 MB) and unpack its headers into .deps/cutlass"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps --disable-pip-version-check -d "$tmp" "$CUTLASS_WHEEL"
  rm -rf .deps/cutlass.partial && mkdir -p .deps
  "$PY" - "$tmp" .deps/cutlass.partial <<'PYEOF'
import glob, os, sys, zipfile
wheel, = glob.glob(os.path.join(sys.argv[1], "*.whl"))
prefix = "cutlass_library/source/"
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if not n.endswith("/") and
             (n.startswith(prefix + "include/") or n.startswith(prefix + "tools/util/include/"))]
    for n in names:
        target = os.path.join(sys.argv[2], n[len(prefix):])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(n) as src, open(target, "wb") as dst:
            dst.write(src.read())
print(f"[deps]   {len(names)} header files")
PYEOF
  mv .deps/cutlass.partial .deps/cutlass
fi
say "ok"
