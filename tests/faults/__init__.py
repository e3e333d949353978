"""The fault matrix: faults injected for real into generation, the model servers, S3, the stored output and
whole `aerie run`s (with and without Prefect), each proven to have fired, the run repeated, and the outcome
compared item by item with an unfaulted run's. A suite of its own, not pytest's (no module here is named
`test_*`): it runs for most of an hour and writes a record.

    python -m tests.faults --out benchmarks/results/faults.json     # or: make faults

matrix.py holds the cases and the command; generation.py, servers.py and prefect_runs.py the cases of
generation, the reference server and Prefect; case.py what a case records.
"""
