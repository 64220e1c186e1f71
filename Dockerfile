# GPU image for the microserver. Build:  docker build -t minimax-microserver .
# Run:    docker run --gpus all -p 30000:30000 minimax-microserver
# The same install steps as `make test` / `make serve`, except that torch comes from the CUDA base image.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# Install the project as `make serve` does; its torch requirement (>=2.5) is met by the base image's
# CUDA build, so pip adds only the other runtime dependencies.
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY mem_cache ./mem_cache
COPY server ./server
RUN python -m pip install -e .
COPY configs ./configs

RUN useradd --create-home --uid 1000 app && chown -R app /app
USER app

EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=4).status == 200 else 1)"

# The device is chosen automatically: CUDA when the container sees a GPU (bf16 there), else CPU (fp32).
ENTRYPOINT ["python", "-m", "server", "--host", "0.0.0.0", "--port", "30000"]
CMD ["--model-path", "configs/tiny"]
