"""The train stage: `aerie.train.work.run` (the work; `stage.TRAIN` in the pipeline), `loop` (the training loop and its wiring),
`data` (shards -> packed rows, prefetch), `objective` (loss and acceptance metrics), `checkpoint`,
`distributed`, `worker` (torchrun entry), `plots`. Importing the package stays cheap (config only)."""
