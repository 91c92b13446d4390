# CUDA image for ninfer: torch + triton from the CUDA wheels, the package installed from source.
#   docker build -t ninfer .
#   docker run --gpus all -p 8080:8080 -v /models:/models:ro ninfer serve /models/model.nfer --host 0.0.0.0
#   docker run --gpus all ninfer bench --random-weights qwen3.6-27b --depths 8k
# Triton compiles its launcher and kernels at run time: it needs a C compiler and the Python headers, which a
# CUDA *runtime* image lacks, so both are installed here.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python3-dev \
        gcc libc6-dev curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/ninfer
ENV PATH=/opt/ninfer/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specs specs
COPY format format
COPY runtime runtime
COPY ninfer_cli ninfer_cli
RUN pip install "torch>=2.4,<2.15" --index-url https://download.pytorch.org/whl/cu128 \
    && pip install '.[gpu,bench]'
# an unprivileged user; Triton's kernel cache in its home; models mounted read-only under /models
RUN useradd --create-home --uid 1000 ninfer && mkdir -p /models
USER ninfer
ENV TRITON_CACHE_DIR=/home/ninfer/.triton
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8080/health || exit 1
ENTRYPOINT ["ninfer"]
CMD ["--help"]
