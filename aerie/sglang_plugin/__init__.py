"""aerie's SGLang extraction plugin: runs inside the SGLang container and writes hidden-state dumps.

    launch.py   entrypoint (`python3 -m aerie.sglang_plugin.launch <sglang args>`): checks the SGLang
                version, rewrites the arguments for prefill-only extraction, registers the plugin with
                SGLang's plugin loader, then execs `sglang.launch_server`
    capture.py  the plugin SGLang loads in every one of its processes: turns on EAGLE-3 aux capture on
                the target and writes one dump per prefill-only request from the logits-processor step
    layers.py   EAGLE-3's layer rule, the one copy (aerie's family imports it from here)
    dumps.py    the dump contract (file names, atomic writes, per-request split of a packed batch)
    compat.py   the SGLang versions this was written against, and the check

Only the standard library, torch and safetensors are imported here (all in the SGLang image), plus
`aerie.errors`; the image copies just `aerie/__init__.py`, `aerie/errors.py`, `aerie/version.py` and this package.
"""
