# SGLang's CPU extraction server with aerie's hidden-state dump plugin, for CPU hosts and the docker tests:
# the environment `make setup-sglang` makes (the CPU torch, sglang==envs/sglang/VERSION --no-deps, the exact
# pins of envs/sglang/requirements.lock) on aerie's base image, and the same plugin layer as the GPU recipe
# (docker/sglang-extract.Dockerfile, FROM lmsysorg/sglang). Built by docker/build-images.sh
# (`make images`), which serves the wheelhouse at WHEELS: nothing is downloaded.
# SGLang's EAGLE speculative decoding does not run on this image (it needs AMX or a GPU); extraction does.
ARG BASE=aerie/base:bookworm
FROM $BASE

ARG WHEELS
ARG SGLANG_VERSION
ARG TORCH_SPEC=torch==2.13.0
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    no_proxy=localhost,127.0.0.1,0.0.0.0 \
    SGLANG_USE_CPU_ENGINE=1

# SGLang's own requirements name CUDA builds that would replace the CPU torch: sglang goes in without
# them and the lock (torch's requirements included) pins the rest; nothing is resolved.
COPY envs/sglang/requirements.lock /tmp/sglang.lock
RUN python3 -m venv /opt/venv \
 && pip install -q --no-cache-dir --no-index --no-deps --find-links "$WHEELS" \
      "$TORCH_SPEC" "sglang==$SGLANG_VERSION" -r /tmp/sglang.lock

# CPU-lane scaffolding, not part of SGLang or aerie: stand-ins for sgl_kernel and torchvision, which have
# no CPU build on PyPI (tests/sglang_cpu_shims/_shim.py says why). SGLang's CPU path on a text model calls
# neither; any call into them raises and is recorded, so a run that needs the real packages fails loudly.
COPY tests/sglang_cpu_shims /opt/sglang-cpu-shims

# plugin layer: begin
COPY aerie/__init__.py aerie/errors.py aerie/version.py /opt/aerie/aerie/
COPY aerie/sglang_plugin/ /opt/aerie/aerie/sglang_plugin/
# plugin layer: end
ENV PYTHONPATH=/opt/aerie:/opt/sglang-cpu-shims

# Fail the build, not the first launch, when the installed SGLang is not the pinned one.
RUN python3 -c "from aerie.sglang_plugin.compat import check_sglang_version, installed_sglang_version as v; print('sglang', check_sglang_version(v()))"

ENTRYPOINT ["python3", "-m", "aerie.sglang_plugin.launch"]
