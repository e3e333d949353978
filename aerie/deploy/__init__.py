"""Deploy a trained drafter: serve it with speculative decoding beside the same server without, on the
same prompts, and promote it only if it pays.

Stage entry point: `deploy(cfg, ctx, drafter=..., evaluation=..., server=...)` (`ctx` the
`aerie.stage.WorkContext`; stage `deploy`; `stage.DEPLOY` in the pipeline). Kept import-free: `aerie.config`
imports `aerie.deploy.config`.

    config.py   DeployConfig
    bench.py    the streaming `/generate` benchmark client (TTFT, ITL, output tokens/s, accept length)
    work.py     deploy(): baseline vs speculative server, promotion
    report.py   the benchmark table and promotion as markdown
    stage.py    DEPLOY: the stage in the pipeline
"""
