"""Lossless speculative decoding with the target in transformers.

decoder.py        SpecDecoder: batched speculative decoding (greedy or sampled), acceptance accounting
eagle.py          the EAGLE-3 drafter as a batched proposer
prompt_lookup.py  the training-free n-gram proposer
backend.py        the reference server's speculative mode (a `GenerationBackend`)
"""
