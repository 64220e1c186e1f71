# Image for the router in router.yaml: sglang-router 0.3.2 from PyPI (the version this project is
# tested against; its wheel ships the Rust router as a Python extension, no build step).
# Build:  docker build -f deploy/router.Dockerfile -t sglang-router:0.3.2 deploy
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN python -m pip install sglang-router==0.3.2

USER 65534:65534
EXPOSE 30000 29000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
