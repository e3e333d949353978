"""EAGLE-3's layer rule, the one copy: which target layers its drafter reads.

It lives in the plugin because the plugin runs inside SGLang's process, where only this package (and
`aerie.errors`) is present; aerie's own code (`aerie.families.eagle3`, `aerie.targets`) imports it from
here. Standard library only.
"""

from __future__ import annotations


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers of a `num_layers` target, output-of-layer ids (SGLang's
    explicit-id convention): outputs of 1, N//2-1 and N-4, the residual streams entering layers 2, N//2
    and N-3 (HF `hidden_states[2]`, `[N//2]`, `[N-3]`)."""
    return [1, num_layers // 2 - 1, num_layers - 4]
