"""aerie's reference model server: the SGLang HTTP subset aerie uses, on transformers.

Run it as ``python -m aerie.engine --model-path DIR`` (CPU or CUDA). It exists so that every
client of a model server (generation, extraction, readiness, teardown, canary) runs for real without
a GPU or Docker, and so that small targets can be served and extracted on one GPU without SGLang.

Modules, in the order a request meets them:

- ``args``        the command line (SGLang's flag names) and its checks
- ``server``      startup in SGLang's order, warm-up, SIGTERM drain; ``main()``
- ``app``         the FastAPI endpoints and their status semantics
- ``protocol``    request bodies (SGLang ``/generate``, OpenAI chat) and their validation
- ``scheduler``   the single model-worker thread and its queues
- ``generation``  ``GenerationBackend`` (the speculative-decoding seam) and ``BatchedDecoder``
- ``extraction``  EAGLE-3 hidden-state capture from packed prefills
- ``packed``      sequence packing and the segment-causal attention it needs
- ``dump``        the atomic ``<rid>.safetensors`` dump contract
- ``loader``      shard-by-shard loading with SGLang's progress lines
- ``sglang_log``  SGLang's log formats
"""
