# The pipeline worker image for CPU hosts: aerie, Prefect, prefect-docker and CPU torch on aerie's base.
# Built by docker/build-images.sh (`make images`), which serves the wheelhouse at WHEELS over the host
# network: the build downloads nothing and reaches no registry.
ARG BASE=aerie/base:bookworm
FROM $BASE

ARG WHEELS
ENV PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /opt/aerie

# Dependencies first (from the lock), so a code change rebuilds only the last layers. The lock is the
# whole set, so nothing is resolved (the data carriers declare dependencies aerie does not need).
COPY docker/worker-cpu.lock /tmp/worker-cpu.lock
RUN python3 -m venv /opt/venv \
 && pip install -q --no-cache-dir --no-index --no-deps --find-links "$WHEELS" -r /tmp/worker-cpu.lock

# pyproject.toml names README.md as the long description: a stub stands in, so a doc edit changes nothing here.
COPY pyproject.toml prefect.yaml ./
RUN echo "aerie: see the repository's README.md" > README.md
COPY aerie ./aerie
COPY flows ./flows
COPY deployments ./deployments
RUN pip install -q --no-cache-dir --no-index --no-deps --no-build-isolation -e . \
 && python -c "import aerie, aerie.engine, aerie.flows.pipeline, prefect_docker, torch"
