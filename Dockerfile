# CPU image of ggufq: placement service, CPU workers, Flower. Models come from a volume.
#   docker build -t ggufq:cpu .
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scheduler ./scheduler
COPY workers ./workers
COPY api_client ./api_client
# llama-cpp-python compiles llama.cpp here (minutes); the runtime image gets the wheels
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 ggufq
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY examples /app/examples
USER ggufq
WORKDIR /app
ENV GGUFQ_MODELS_DIR=/models GGUFQ_STATE_DIR=/home/ggufq/.ggufq
ENTRYPOINT ["ggufq"]
CMD ["--help"]
