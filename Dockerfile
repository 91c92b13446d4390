# CUDA image for ninfer: torch + triton from the CUDA wheels, the package installed from source.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
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
    && pip install '.[gpu]'
ENTRYPOINT ["ninfer"]
CMD ["--help"]
