"""aerie's inference engine on transformers: the reference model server and lossless speculative decoding.

    server/        the reference server (`python -m aerie.engine --model-path DIR`): SGLang's HTTP subset,
                   EAGLE-3 hidden-state extraction, continuous batching
    speculative/   speculative decoding: the batched decoder, its proposers (EAGLE-3, prompt lookup) and
                   the server's speculative backend
    generation.py  the generation seam both share (`GenerationBackend`) and the plain batched decoder

The engine imports no stage: the evaluation stage and the benchmarks use it, not the other way round.
"""
