# GPU image for the microserver. Build:  docker build -t minimax-microserver .
# Run:    docker run --gpus all -p 30000:30000 minimax-microserver
# The same install steps as `make test` / `make serve`, with the torch version the tests run (2.13.0):
# the captured decode graphs depend on the compiler's version. PyPI's Linux x86_64 torch wheel is the
# CUDA build (CUDA runtime libraries as pip packages), so the image needs only the host's NVIDIA driver.
FROM python:3.11-slim

# A C/C++ compiler: inductor builds its CPU kernels and Triton its CUDA launchers with it at run time.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*

# The compile cache (decode graphs; the Triton decode kernels' builds under triton/) lives here; mount a volume on it
# to keep restarts fast.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TORCHINDUCTOR_CACHE_DIR=/app/.cache/inductor \
    TRITON_CACHE_DIR=/app/.cache/inductor/triton
WORKDIR /app

RUN python -m pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY mem_cache ./mem_cache
COPY server ./server
RUN python -m pip install -e .
COPY configs ./configs

RUN useradd --create-home --uid 1000 app && mkdir -p /app/.cache/inductor && chown -R app /app
USER app
# The compile cache (CPU decode graphs, C kernels, Triton's builds): a volume, so a restarted container loads what it built (seconds)
VOLUME /app/.cache/inductor

EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=4).status == 200 else 1)"

# The device is chosen automatically: CUDA when the container sees a GPU (bf16 there), else CPU (fp32).
ENTRYPOINT ["python", "-m", "server", "--host", "0.0.0.0", "--port", "30000"]
CMD ["--model-path", "configs/tiny"]
