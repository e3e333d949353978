"""The extraction canary: one real corpus sample proves the server writes the right hidden states.

HTTP 200 proves nothing about hidden states. After readiness, before any shard is
written, the canary extracts one sample and checks:

- the dump exists, with `aux_hidden [T, kH]` (k captured layers), `last_hidden [T, H]`, a float dtype, finite values and
  exactly the token ids sent;
- `last_hidden` is the lm_head's input (after the final norm): the target's lm_head applied to the last
  position picks the token the server itself generates greedily (`max_new_tokens=1`). A pre-norm
  state gives other logits;
- when the target fits in memory here, each aux block equals the residual stream entering its layer
  (EAGLE-3: 2, N//2, N-3; DFlash: its config's list, `extract.capture_layers`) of a transformers forward (HF `hidden_states[i]`) within `canary_rtol`, and no *other*
  layer matches it better. That catches the +-1 layer-id error that cost peers acceptance length.

An fp8 dump (reference server, `--dump-dtype fp8`) is dequantized first and checked the same way, with
fp8's own error on top of `canary_rtol`: per-token e4m3 rounding measured 0.018-0.022 median relative
error on SmolLM2's states (bf16 rounding: ~0.002 to ~0.015), so `FP8_EXTRA_RTOL` is 0.03, while the
neighbouring layers the check tells apart differ by > 0.25.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from aerie.errors import CanaryError, ExtractionError
from aerie.extract.client import Batch, ExtractionClient
from aerie.extract.corpus_rows import Row
from aerie.fp8 import dequantize_fp8
from aerie.targets import TargetInfo

if TYPE_CHECKING:
    from aerie.serving import ModelServer

CANARY_MAX_TOKENS = 512
FP8_EXTRA_RTOL = 0.03  # added to canary_rtol for fp8 dumps (see the module docstring)
# The lm_head check accepts the server's greedy token within this share of the logit range below the
# max (a near-tie flipped by rounding); fp8 rounds coarser than bf16.
TIE_SHARE = {"model": 0.01, "fp8": 0.02}


@dataclass
class CanaryResult:
    """What the canary checked (recorded in the manifest)."""

    sample_id: str
    tokens: int
    dtype: str
    aux_shape: list[int]
    last_shape: list[int]
    greedy_token: int
    lm_head_token: int
    numeric: dict[str, Any] | None = None
    server_url: str = ""
    checks: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return asdict(self)


def pick_sample(rows: list[Row]) -> Row:
    """The first row short enough to check quickly (the first row if none is)."""
    for row in rows:
        if 2 <= len(row.input_ids) <= CANARY_MAX_TOKENS:
            return row
    return rows[0]


def load_lm_head(target: TargetInfo) -> torch.Tensor:
    """The target's lm_head weight [V, H], read alone from its safetensors (tied: the embedding)."""
    root = Path(target.path)
    names = ["lm_head.weight"] + (
        ["model.embed_tokens.weight"] if target.geometry.tie_word_embeddings else []
    )
    index = root / "model.safetensors.index.json"
    files: dict[str, str] = {}
    if index.is_file():
        files = json.loads(index.read_text())["weight_map"]
    for name in names:
        candidates = [files[name]] if name in files else [p.name for p in root.glob("*.safetensors")]
        for fname in candidates:
            with safe_open(str(root / fname), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __contains__
                    return f.get_tensor(name)
    raise CanaryError(f"cannot find the lm_head weight ({' or '.join(names)}) in {root}")


def lm_head_argmax(last: torch.Tensor, weight: torch.Tensor, chunk: int = 16384) -> tuple[int, torch.Tensor]:
    """argmax of weight @ last in float32, over vocabulary chunks (Kimi's lm_head is 163840 x 7168)."""
    x = last.float()
    logits = torch.cat([weight[i : i + chunk].float() @ x for i in range(0, weight.shape[0], chunk)])
    return int(logits.argmax()), logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Median over tokens of |a - b| / |b| per token. A whole-tensor norm would be dominated by the
    few attention-sink tokens whose residual norms are 100x the rest: on SmolLM2 it separates layers
    15 and 16 by only 0.012, less than bf16 noise; per token the median gap is > 0.25, bf16 ~0.015."""
    a, b = a.detach().float(), b.detach().float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).median())


def compare_layers(
    aux: torch.Tensor,
    last: torch.Tensor,
    hidden_states: list[torch.Tensor],
    aux_layers: list[int],
    rtol: float,
) -> dict[str, Any]:
    """Match each aux block against every HF `hidden_states[j]`; raise unless block k best matches
    `hidden_states[aux_layers[k]]` within `rtol`. `hidden_states[-1]` is HF's post-norm final state."""
    h = last.shape[-1]
    n_layers = len(hidden_states) - 1
    blocks = []
    for k, want in enumerate(aux_layers):
        block = aux[:, k * h : (k + 1) * h]
        errs = [rel_err(block, hidden_states[j]) for j in range(n_layers)]  # pre-norm states only
        best = min(range(n_layers), key=errs.__getitem__)
        blocks.append(
            {"block": k, "expected": want, "best": best, "rel_err": errs[want], "best_rel_err": errs[best]}
        )
        measured = (
            f"best match hidden_states[{best}] at rel err {errs[best]:.3g}, the expected [{want}] at "
            f"{errs[want]:.3g}, tolerance canary_rtol {rtol}"
        )
        if errs[best] > rtol:
            # No layer agrees: a layer offset would be a guess. Wrong weights, dtype or a broken forward.
            raise CanaryError(
                f"aux block {k} (input of layer {want}) matches no layer of the reference forward within "
                f"tolerance ({measured}): the server's hidden states are wrong or far less precise than "
                "expected"
            )
        if best != want:
            off = best - want
            what = "off by one" if abs(off) == 1 else f"off by {off}"
            raise CanaryError(
                f"aux block {k} matches hidden_states[{best}], not [{want}]: the server captures layer "
                f"outputs {what} ({measured}; hidden_states[i] is the residual stream entering layer i)"
            )
    last_err = rel_err(last, hidden_states[-1])
    if last_err > rtol:
        pre = rel_err(last, hidden_states[n_layers - 1]) if n_layers else float("inf")
        raise CanaryError(
            f"last_hidden differs from the reference post-norm final state by rel err {last_err:.3g} > "
            f"{rtol} (vs the pre-norm input of the last layer: {pre:.3g}): it is not the lm_head's input"
        )
    return {"blocks": blocks, "last_rel_err": last_err, "rtol": rtol}


def reference_hidden_states(target: TargetInfo, input_ids: list[int]) -> list[torch.Tensor]:
    """HF `hidden_states` (N+1 tensors [T, H], float32) of the target on CPU."""
    model = target.load_model("cpu", "float32")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([input_ids]), output_hidden_states=True, use_cache=False)
        return [h[0] for h in out.hidden_states]
    finally:
        del model


def _dequantized(
    aux: torch.Tensor, aux_scale: torch.Tensor, last: torch.Tensor, last_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 dump's states in float32, for the numeric checks."""
    try:
        return dequantize_fp8(aux, aux_scale, torch.float32), dequantize_fp8(last, last_scale, torch.float32)
    except RuntimeError as exc:  # scales that do not fit the codes
        raise CanaryError(
            f"canary fp8 dump: cannot dequantize aux_hidden {list(aux.shape)} / aux_scale "
            f"{list(aux_scale.shape)}, last_hidden {list(last.shape)} / last_scale {list(last_scale.shape)}: {exc}"
        ) from exc


def fits_in_memory(target: TargetInfo) -> bool:
    """True when a float32 copy of the target takes under a quarter of the available memory."""
    import psutil

    float32_bytes = target.size_bytes * 2 if target.size_bytes else float("inf")
    return float32_bytes < psutil.virtual_memory().available / 4


class ExtractionCanary:
    """`ModelServer`'s canary hook for extraction servers. The reference forward (when enabled) is
    computed once and reused across server restarts."""

    def __init__(
        self,
        target: TargetInfo,
        sample: Row,
        *,
        reference: bool,
        rtol: float,
        timeout_s: float = 120.0,
        layers: list[int] | None = None,
    ) -> None:
        self.target = target
        # HF hidden_states indices of the captured layers (input-of-layer); EAGLE-3's by default.
        self.layers = list(layers) if layers is not None else target.aux_layers_input
        self.sample = sample
        self.reference = reference
        self.rtol = rtol
        self.timeout_s = timeout_s
        self.result: CanaryResult | None = None
        self._hidden: list[torch.Tensor] | None = None
        self._lm_head: torch.Tensor | None = None
        # Servers of a fan-out start in parallel threads: compute the reference once.
        self._lock = threading.Lock()

    def __call__(self, server: ModelServer) -> None:
        if server.spec.dump_dir is None:
            raise CanaryError(f"{server.spec.name} was launched without a dump dir: not an extraction server")
        self.run_against(server.url, server.spec.dump_dir)

    def run_against(self, url: str, dump_dir: Path) -> CanaryResult:
        result = asyncio.run(self._run(url, Path(dump_dir)))
        self.result = self.result or result
        return result

    async def _run(self, url: str, dump_dir: Path) -> CanaryResult:
        row = self.sample
        client = ExtractionClient(
            url, dump_dir, request_timeout_s=self.timeout_s, dump_timeout_s=self.timeout_s
        )
        tag = uuid.uuid4().hex[:8]
        try:
            try:
                (sample,) = await client.extract(Batch([row], [f"aerie-canary-{tag}"]))
                greedy = await client.greedy_next_token(row.input_ids, f"aerie-canary-next-{tag}")
            except ExtractionError as exc:
                raise CanaryError(f"canary extraction of corpus row {row.id} at {url} failed: {exc}") from exc
        finally:
            await client.aclose()
        if sample.aux_scale is not None and sample.last_scale is not None:
            aux, last = _dequantized(
                sample.aux_hidden, sample.aux_scale, sample.last_hidden, sample.last_scale
            )
            return self.check(aux, last, greedy, url=url, fp8=True)
        return self.check(sample.aux_hidden, sample.last_hidden, greedy, url=url)

    def check(
        self, aux: torch.Tensor, last: torch.Tensor, greedy: int, *, url: str = "", fp8: bool = False
    ) -> CanaryResult:
        """Every check on one extracted sample (the ids were already checked against the corpus).
        `fp8`: the states are an fp8 dump's, dequantized (the tolerances allow fp8's rounding)."""
        t, h, k = len(self.sample.input_ids), self.target.geometry.hidden_size, len(self.layers)
        checks = []
        if tuple(aux.shape) != (t, k * h) or tuple(last.shape) != (t, h):
            raise CanaryError(
                f"canary dump shapes aux_hidden {list(aux.shape)}, last_hidden {list(last.shape)}; expected "
                f"[{t}, {k * h}] and [{t}, {h}] ({k} captured layers of hidden size {h})"
            )
        checks.append("shapes")
        if not aux.is_floating_point() or aux.dtype != last.dtype:
            raise CanaryError(
                f"canary dump dtypes aux {aux.dtype}, last {last.dtype}: expected one float dtype"
            )
        checks.append("dtype")
        for name, x in (("aux_hidden", aux), ("last_hidden", last)):
            bad = (~torch.isfinite(x)).sum().item()
            if bad:
                raise CanaryError(f"canary {name} has {bad} non-finite values (NaN/inf)")
        checks.append("finite")
        checks.append("token ids")
        with self._lock:
            if self._lm_head is None:
                self._lm_head = load_lm_head(self.target)
        top, logits = lm_head_argmax(last[-1], self._lm_head)
        # bf16 servers may flip a near-tie: accept the server's token when its logit is within 1% (fp8
        # dumps: 2%) of the logit range below the max; a pre-norm state misses by far more.
        tol = TIE_SHARE["fp8" if fp8 else "model"] * float(logits.max() - logits.median())
        if top != greedy and float(logits[greedy]) < float(logits.max()) - tol:
            raise CanaryError(
                f"last_hidden is not the lm_head's input: lm_head(last_hidden[-1]).argmax() = {top} but the "
                f"server's greedy next token is {greedy} (logit {float(logits[greedy]):.3f} vs max "
                f"{float(logits.max()):.3f}); last_hidden must be taken after the final norm"
            )
        checks.append("post-norm (lm_head argmax = greedy token)")
        numeric = None
        if self.reference:
            with self._lock:
                if self._hidden is None:
                    self._hidden = reference_hidden_states(self.target, self.sample.input_ids)
            rtol = self.rtol + FP8_EXTRA_RTOL if fp8 else self.rtol
            numeric = compare_layers(aux, last, self._hidden, self.layers, rtol)
            checks.append("aux layers match the reference forward")
        return CanaryResult(
            sample_id=self.sample.id,
            tokens=t,
            dtype="float8_e4m3fn" if fp8 else str(aux.dtype).removeprefix("torch."),
            aux_shape=list(aux.shape),
            last_shape=list(last.shape),
            greedy_token=greedy,
            lm_head_token=top,
            numeric=numeric,
            server_url=url,
            checks=checks,
        )
