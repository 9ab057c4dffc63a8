#!/usr/bin/env bash
# Optional, for the GPU tests with vLLM (tests/test_gpu_vllm.py) on a machine whose image has
# torch 2.11 (CUDA 13) and no vLLM, reached with at most 64 MiB of files (this project's H200
# device machine): writes .vllm-gpu/site.tar.xz, vLLM 0.26.0 (the last release built on torch
# 2.11) cut to what an H200 runs, and the packages it imports that the image lacks. On the GPU
# machine: `mkdir -p /tmp/vllm-site && tar -xJf .vllm-gpu/site.tar.xz -C /tmp/vllm-site` and put it
# on PYTHONPATH. What is cut, and why the rest still runs:
# - the flash-attention, FlashMLA, DeepGEMM, qutlass and Rust parts: the tests select vLLM's
#   Triton attention backend and run no MLA, DeepGEMM or tool parser (vllm_flash_attn's import,
#   which vLLM makes on any CUDA machine, refuses without its kernels: that one check is removed);
# - in vLLM's two kernel libraries, the machine code for GPUs other than sm_90
#   (scripts/fatbin_keep_arch.py);
# - `ray`: vLLM's ipc weight-transfer module imports it at module level for its Ray send mode;
#   an empty module stands in (the tests send through vLLM's own update_weights call).
# Needs pip and about 1 GB of scratch space; takes a few minutes (the wheel is 300 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.vllm-gpu
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$WORK" vllm==0.26.0
SITE="$WORK/site"
mkdir -p "$SITE"
(cd "$SITE" && python3 -m zipfile -e "$WORK"/vllm-0.26.0-*.whl .)
rm -rf "$SITE"/vllm/vllm_flash_attn/*.so "$SITE"/vllm/third_party/deep_gemm "$SITE"/vllm/third_party/fmha_sm100 \
       "$SITE"/vllm/_flashmla* "$SITE"/vllm/_qutlass_C* "$SITE"/vllm/vllm-rs "$SITE"/vllm/_rust_tool_parser*
python3 - "$SITE/vllm/vllm_flash_attn/__init__.py" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
guard = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("
assert guard in text, f"{path}: the flash-attention import check has changed"
open(path, "w").write(text.replace(guard, "if False:  # mconv's bundle ships no flash-attention kernels\n    raise ImportError("))
EOF
for lib in "$SITE"/vllm/_C_stable_libtorch.abi3.so "$SITE"/vllm/_moe_C_stable_libtorch.abi3.so; do
    python3 scripts/fatbin_keep_arch.py "$lib" 90
done
# The packages vLLM 0.26.0 imports to build an offline LLM, load Qwen3 / Qwen3-MoE (bf16, block FP8)
# and run its ipc weight-transfer backend, less those the device image has (its list: the device
# README's KINDS.md), at the versions a resolve of vLLM's requirements gave on 2026-12-03; and, for
# `vllm serve` (vllm.entrypoints.openai.api_server), the five its modules import beyond those (uvicorn,
# prometheus-fastapi-instrumentator, model-hosting-container-standards and its jmespath, watchfiles),
# found by reading the imports of vLLM 0.26.0's entrypoints: not yet run on the device.
python3 -m pip install --quiet --no-deps "${PLATFORM[@]}" --no-compile --target "$SITE" \
    annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 cachetools==8.0.2 cbor2==6.3.0 compressed-tensors==0.17.0 \
    dill==0.4.1 loguru==0.7.3 \
    email-validator==2.4.0 fastapi==0.136.3 googleapis-common-protos==1.76.0 httpx2==2.16.2 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 llguidance==1.7.6 mistral-common==1.13.1 msgspec==0.23.0 openai==3.57.0 \
    openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pycountry==26.2.16 pydantic==2.14.4 \
    pydantic-extra-types==2.11.1 pydantic-core==2.50.5 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 \
    rpds-py==2026.9.1 sniffio==1.3.1 starlette==1.10.0 typing-inspection==0.4.5 xgrammar==0.2.9 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
    opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
    opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1 \
    uvicorn==0.55.0 prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 \
    jmespath==1.1.0 watchfiles==1.3.0
mkdir -p "$SITE/ray"
echo '"""Stands in for Ray: vLLM 0.26 ipc_engine imports it at module level for its Ray send mode, unused here."""' \
    > "$SITE/ray/__init__.py"
mkdir -p "$OUT"
tar -C "$SITE" -cf - . | xz -9 -T0 > "$OUT/site.tar.xz.tmp"
mv "$OUT/site.tar.xz.tmp" "$OUT/site.tar.xz"
SIZE=$(stat -c %s "$OUT/site.tar.xz")
echo "$OUT/site.tar.xz: $((SIZE >> 20)) MiB"
# The device machine takes at most 64 MiB of files in a call, the repository and megatron-core's wheels too.
[ "$SIZE" -le $((58 << 20)) ] || { echo "bundle-vllm-gpu: $OUT/site.tar.xz is over 58 MiB: it and the rest will not travel" >&2; exit 1; }
