# CPU image of ggufq (the operations issue adds a CUDA image). Models come from a volume.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY scheduler ./scheduler
COPY workers ./workers
COPY api_client ./api_client
COPY examples ./examples
RUN pip install --no-cache-dir .
ENV GGUFQ_MODELS_DIR=/models
ENTRYPOINT ["ggufq"]
