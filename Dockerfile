# berth service image: the planner API (no torch) by default; the executor image adds torch:
#   docker build -t berth .                                # planner service, ~200 MB
#   docker build -t berth-executor --build-arg WITH_TORCH=1 .   # + torch 2.13.0 CPU, for /v1/validations
#   docker run -p 8000:8000 -v berth-data:/data berth
FROM python:3.11-slim

ARG WITH_TORCH=0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BERTH_STORE_PATH=/data/berth.sqlite

WORKDIR /app
COPY pyproject.toml README.md ./
COPY specs ./specs
COPY hardware_profiles ./hardware_profiles
COPY topology ./topology
COPY cost_models ./cost_models
COPY planner ./planner
COPY executor ./executor
COPY launch ./launch
COPY api ./api
COPY cli ./cli
RUN pip install . \
    && if [ "$WITH_TORCH" = "1" ]; then \
         pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
       fi

RUN useradd --create-home --uid 10001 berth && mkdir -p /data && chown berth:berth /data
USER berth
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]

ENTRYPOINT ["berth", "serve", "--host", "0.0.0.0", "--port", "8000"]
