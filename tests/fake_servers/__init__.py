"""Small scripted servers that start, fail and answer the way SGLang does (run them as scripts)."""
