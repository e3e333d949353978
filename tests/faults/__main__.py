"""`python -m tests.faults`: the fault matrix (tests/faults/matrix.py)."""

from tests.faults.matrix import main

main()
