# GPU-node image for palaestra: CUDA, SGLang engines, megatron-core trainer, palaestra with extras.
#
# STATUS: NOT BUILT OR TESTED. It was written on a CPU-only machine without an image registry or
# network access to PyPI's CUDA wheels, so it has never been built; the first build on a GPU node
# must be recorded here (date, host, digest) by whoever does it. Versions are floors, not pins.
#
# Build (from the repo root):
#   docker build -t palaestra:gpu .
# Run a recipe on one 8-GPU node (host networking so Ray and SGLang ports are reachable; a large
# /dev/shm for NCCL and Ray's object store; models and run directories mounted in):
#   docker run --gpus all --network host --ipc host --shm-size 32g \
#     -v /models:/models -v "$PWD/runs:/workspace/palaestra/runs" \
#     -e PALAESTRA_BACKEND=megatron palaestra:gpu bash scripts/run_gsm8k_grpo.sh
# Plan only (no GPUs needed):
#   docker run --rm palaestra:gpu bash scripts/run_search_r1.sh --dry-run
#
# megatron-core needs Python >= 3.12 (pyproject's `megatron` extra), so the base is Ubuntu 24.04.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python, build tools for CUDA extensions, curl (the scripts' health checks), bubblewrap (sandbox)
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev build-essential git curl ca-certificates \
        bubblewrap libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip setuptools wheel

# SGLang first: it pins the torch build its kernels were compiled against; everything after
# reuses that torch instead of pulling another one.
RUN pip install "sglang[all]>=0.4.6"

# megatron-core (plus transformer-engine for sequence parallelism and fused kernels; optional,
# the backend falls back to its SDPA attention without it)
RUN pip install "megatron-core>=0.19" \
    && (pip install --no-build-isolation "transformer_engine[pytorch]" \
        || echo "transformer-engine not installed: the Megatron backend uses its SDPA path")

WORKDIR /workspace/palaestra
COPY . .
# palaestra with its extras (ray, sglang, megatron, sandbox); dev for running the test suite
RUN pip install -e ".[ray,sglang,megatron,sandbox,dev]"

# Fail the build early if the pieces do not import together.
RUN python -c "import torch, sglang, megatron.core, ray, palaestra; print(torch.__version__, sglang.__version__)" \
    && palaestra train configs/gsm8k_grpo.toml --dry-run > /dev/null

CMD ["bash"]
