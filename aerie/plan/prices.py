"""API cost: the endpoint config's per-million-token prices (and the date they were taken) times the
prompt and completion tokens the plan expects."""

from __future__ import annotations

from dataclasses import dataclass

from aerie.generate.config import EndpointConfig
from aerie.plan.sizes import Sizes


@dataclass(frozen=True)
class Cost:
    input_usd: float | None
    output_usd: float | None
    note: str

    @property
    def total_usd(self) -> float | None:
        if self.input_usd is None or self.output_usd is None:
            return None
        return self.input_usd + self.output_usd


def api_cost(endpoint: EndpointConfig, sizes: Sizes) -> Cost:
    if endpoint.base_url is None:
        return Cost(0.0, 0.0, "generated on this machine's reference server: no API cost")
    if endpoint.price_input_per_mtok is None or endpoint.price_output_per_mtok is None:
        return Cost(
            None,
            None,
            f"{endpoint.base_url}: no prices in the config "
            "(set generate.endpoint.price_input_per_mtok, price_output_per_mtok and prices_date)",
        )
    return Cost(
        sizes.prompt_tokens / 1e6 * endpoint.price_input_per_mtok,
        sizes.completion_tokens / 1e6 * endpoint.price_output_per_mtok,
        f"${endpoint.price_input_per_mtok:.2f} in / ${endpoint.price_output_per_mtok:.2f} out per million "
        f"tokens for {endpoint.model or 'the endpoint'}, as of {endpoint.prices_date}",
    )
