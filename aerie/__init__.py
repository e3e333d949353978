"""aerie: train EAGLE-3 speculative-decoding drafters end to end.

The library is Prefect-free: each stage is a module with a typed ``run(cfg, ...) -> Result``;
the Prefect flows in ``flows/`` only compose, retry and report.
"""

__version__ = "0.1.0"
