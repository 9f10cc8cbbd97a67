#!/usr/bin/env bash
# Builds build-cuda/libsp_cuda_test.so: the CUDA backend (src/cuda) + the ctypes shim, straight with nvcc (no CMake,
# no Python package), so the GPU tests and the benchmark only need torch. Usage: tests/gpu/build.sh [build_dir] [jobs]
# A/B variants: SP_VARIANT=pingpong SP_VARIANT_FLAGS="-DSP_PINGPONG" builds build_dir/libsp_cuda_test_<name>.so.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="${1:-$ROOT/build-cuda}"
JOBS="${2:-2}"
mkdir -p "$BUILD"
if [[ -n "${SP_CUTLASS_ROOT:-}" ]]; then CUT="$SP_CUTLASS_ROOT"
elif [[ -d "$ROOT/.deps/cutlass/include/cute" ]]; then CUT="$ROOT/.deps/cutlass"
else CUT="$(python3 -c 'import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),"source"))')"
fi
NVCC="${NVCC:-nvcc}"
FLAGS=(-std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr --expt-extended-lambda -O3 -lineinfo
       -Xptxas=-v -DNDEBUG -I"$ROOT/include" -I"$ROOT/src" -I"$CUT/include" -I"$CUT/tools/util/include"
       -Xcompiler -fPIC ${SP_VARIANT_FLAGS:-})
LIBNAME="libsp_cuda_test${SP_VARIANT:+_$SP_VARIANT}.so"
OBJDIR="$BUILD${SP_VARIANT:+/variant_$SP_VARIANT}"
mkdir -p "$OBJDIR"
SRCS=("$ROOT"/src/cuda/fwd_*.cu "$ROOT/src/cuda/cuda_backend.cpp" "$ROOT/tests/gpu/sp_cuda_shim.cpp")
OBJS=()
pids=()
for s in "${SRCS[@]}"; do
  o="$OBJDIR/$(basename "$s").o"
  OBJS+=("$o")
  if [[ ! -f "$o" || "$s" -nt "$o" || -n "$(find "$ROOT/src/cuda" -name '*.h' -newer "$o" 2>/dev/null)" ]]; then
    ( "$NVCC" "${FLAGS[@]}" -c "$s" -o "$o" > "$o.log" 2>&1 || { cat "$o.log"; exit 1; } ) &
    pids+=($!)
    while (( $(jobs -rp | wc -l) >= JOBS )); do sleep 0.5; done
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
"$NVCC" -shared -o "$BUILD/$LIBNAME" "${OBJS[@]}" -cudart static
# Host-only exhaustive check of the block iterator (the producer/consumer seam); no GPU needed.
g++ -std=c++17 -O2 -I"$ROOT/src" "$ROOT/tests/gpu/test_block_iterator.cpp" -o "$BUILD/test_block_iterator"
grep -h "registers\|spill" "$OBJDIR"/*.o.log 2>/dev/null | sort | uniq -c || true
echo "built $BUILD/$LIBNAME"
