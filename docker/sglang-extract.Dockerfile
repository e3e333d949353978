# SGLang with aerie's hidden-state dump plugin: the extraction server of the production pipeline.
#
#   docker build -f docker/sglang-extract.Dockerfile -t aerie/sglang-extract:0.5.23 .
#   docker run --gpus all --ipc=host -v /data/dumps:/data/dumps -v /models:/models \
#     aerie/sglang-extract:0.5.23 --model-path /models/target --tp-size 8 \
#     --host 0.0.0.0 --port 30000 --weight-version run-<nonce> --dump-dir /data/dumps
#
# The plugin patches SGLang internals and refuses any SGLang version other than the one below
# (aerie/sglang_plugin/compat.py); bump both together after re-reading the patched code.
FROM lmsysorg/sglang:v0.5.23

# The plugin layer: only what the plugin imports, aerie's package marker, its error tree and the plugin
# itself (torch and safetensors come with the image); nothing else of aerie (Prefect, polars...). The CPU
# recipe (docker/sglang-cpu.Dockerfile) has the same lines, and tests/test_images.py checks they agree.
# plugin layer: begin
COPY aerie/__init__.py aerie/errors.py aerie/version.py /opt/aerie/aerie/
COPY aerie/sglang_plugin/ /opt/aerie/aerie/sglang_plugin/
# plugin layer: end
ENV PYTHONPATH=/opt/aerie \
    no_proxy=localhost,127.0.0.1,0.0.0.0 \
    PYTHONUNBUFFERED=1

# Fail the build, not the first launch, when the base image's SGLang is not the pinned one.
RUN python3 -c "from aerie.sglang_plugin.compat import check_sglang_version, installed_sglang_version as v; print('sglang', check_sglang_version(v()))"

ENTRYPOINT ["python3", "-m", "aerie.sglang_plugin.launch"]
