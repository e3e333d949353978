"""Configuration of the hidden-state extraction stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from aerie.configbase import StrictModel
from aerie.shards.schema import AUX_LAYERS
from aerie.targets import TargetInfo

SPLITS: tuple[Literal["train", "eval"], ...] = ("train", "eval")


class ExtractConfig(StrictModel):
    """Prefill the corpus through the target and pack hidden states into shards."""

    storage_dtype: Literal["bf16", "fp8"] = Field(
        "bf16", description="bf16, or fp8 e4m3 with per-token scales (half the bytes)."
    )
    shard_bytes: int = Field(1 << 30, ge=1 << 16, description="Target size of one shard file.")
    batch_tokens: int = Field(16384, ge=64, description="Tokens per /generate request (many sequences each).")
    requests_in_flight: int = Field(2, ge=1, description="Concurrent /generate requests per server.")
    num_servers: int = Field(
        1, ge=1, description="Servers extracting in parallel, each a contiguous slice of the corpus."
    )
    num_slices: int = Field(
        1,
        ge=1,
        description="Hosts extracting in parallel: the corpus is cut into num_slices x num_servers contiguous "
        "ranges and slice k (one host, its own num_servers servers) runs ranges k*num_servers.., into the "
        "same store; `assemble` then writes the manifest. Without `slice_deployment` the slices run here, "
        "one after the other.",
    )
    slice_deployment: str | None = Field(
        None,
        description="Prefect deployment of one slice (flow/deployment, e.g. 'extract-slice/slice-gpu'): when set, "
        "the extraction stage's flow runs each unfinished slice through it (run_deployment, all at once) "
        "and assembles; None = here, one after the other (under Prefect a subflow each).",
    )
    max_restarts: int = Field(
        2, ge=0, description="Restarts of a server that dies mid-extraction (per server)."
    )
    delete_local_after_upload: bool = Field(
        False, description="Delete a shard's local copy once its upload is verified."
    )
    work_dir: str | None = Field(
        None, description="Local dir for dumps and shards; None = <aerie cache>/extract/<run>/<key>."
    )
    dump_dir: str | None = Field(
        None,
        description="Where servers write per-request dumps; None = /dev/shm (tmpfs: dumps are written and "
        "read back once, at the GPU's rate) when it has room for the dumps in flight, else <work_dir>/dumps.",
    )
    quantize_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where fp8 shards are quantized. auto = cpu, on the commit_workers threads: that scales "
        "with the cores and leaves the GPU to the server; cuda quantizes each sample on this process's GPU "
        "(transfers and a sync per sample, behind the server's forward passes).",
    )
    quantize_on_server: bool = Field(
        False,
        description="With storage_dtype fp8 and the reference server: the server quantizes each pack on its "
        "device before the copy to the host (--dump-dtype fp8), so dumps, their reads and the client carry "
        "half the bytes and the client does no quantization; the shards are the same (one function both "
        "sides). Refused with bf16 storage (fp8 dumps would make bf16 shards lossy) and with SGLang (its "
        "dump plugin writes the model dtype).",
    )
    commit_workers: int | None = Field(
        None,
        ge=1,
        description="Threads per server encoding samples for the shards (fp8 quantization, casts), while one "
        "thread appends them in row order and another writes closed shards; the shards are byte-identical "
        "for any count. None = half this host's CPUs (os.cpu_count()) shared by its num_servers, 1 to 16.",
    )
    commit_buffer_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens of samples a server's pump may hand to the commit path before it waits (samples "
        "mapped from their dumps, not yet in the open shard). It lets the pump keep requests going "
        "while a shard is sealed and written. None = 4 x batch_tokens.",
    )
    direct_io: bool = Field(
        False,
        description="Write shards with O_DIRECT (through aligned bounce buffers, no page cache) where the "
        "filesystem takes it. The disk takes O_DIRECT writes faster (H200 hosts: 1.83 GB/s against 1.15 GB/s "
        "through the page cache, benchmarks/results/disk_write-h200.json). With reread_shards on, as it "
        "was then, fp8 extraction lost with it (291-352K tokens/s against 375-443K on three hosts, "
        "benchmarks/README.md): each shard was read back from the "
        "disk, not the page cache. Without the read-back it ran a little ahead on one host (469K against 451K "
        "and 457K, benchmarks/results/extract_reread-h200.json) and level on another in an "
        "ABAB run (467K, 487K against 445K, 494K, extract-h200.json), so it stays off by default. Either way each shard is fsynced before it counts.",
    )
    reread_shards: bool = Field(
        False,
        description="Before a local store takes a shard over (delete_local_after_upload), read it back "
        "and check it has the sha256 computed while it was written. Off by default: the digest is "
        "recorded as computed from the bytes the writer wrote and fsynced. A read-back of a shard "
        "written through the page cache reads the cache, not the disk, so it checks only aerie's own "
        "writer (which the tests do), at the cost of a second sha256 pass over every shard; after "
        "direct_io writes it does read the disk, and takes the bandwidth the writes need. An upload "
        "to S3 reads and checks every shard either way.",
    )
    disk_margin: float = Field(1.2, ge=1.0, description="Preflight asks for estimated bytes x this margin.")
    splits: list[Literal["train", "eval"]] = Field(
        default_factory=lambda: list(SPLITS), description="Corpus splits to extract."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Timeout of one /generate request (a whole batch's prefill)."
    )
    dump_timeout_s: float = Field(
        120.0, gt=0, description="How long to wait for a dump file after the server replied."
    )
    canary_reference: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Compare the canary's aux layers with a transformers forward: auto = when the "
        "target fits in a quarter of this machine's free memory.",
    )
    canary_rtol: float = Field(
        0.05, gt=0, description="Relative error allowed between server and reference hidden states."
    )
    capture_layers: list[int] | None = Field(
        None,
        min_length=1,
        description="Target layers the servers capture, output-of-layer ids (SGLang's convention). None = "
        "the layers train.drafter's family names: EAGLE-3's three, or train.drafter.num_target_layers "
        "spread over the target (the pipeline fills it in).",
    )

    @model_validator(mode="after")
    def _server_quantization_needs_fp8_storage(self) -> ExtractConfig:
        problem = server_quantization_problem(self, "reference")
        if problem:
            raise ValueError(problem)
        return self

    @property
    def aux_layers(self) -> int:
        """How many layers a token's captured states hold (the shards' and dumps' width, in H)."""
        return len(self.capture_layers) if self.capture_layers is not None else AUX_LAYERS

    def layers_output(self, target: TargetInfo) -> list[int]:
        """The captured layers, output-of-layer ids: `capture_layers`, or EAGLE-3's."""
        return list(self.capture_layers) if self.capture_layers is not None else target.aux_layers_output

    def layers_input(self, target: TargetInfo) -> list[int]:
        """The same layers as HF `hidden_states` indices (the residual stream entering layer id + 1)."""
        return [i + 1 for i in self.layers_output(target)]

    def resolved_commit_buffer_tokens(self) -> int:
        """`commit_buffer_tokens`, or 4 batches: with one, on an H200 the pump spent half its time
        waiting to hand its next batch over while the append thread sat idle 70% of the time; 4 took
        the fp8 pipeline from 281K to 299K tokens/s (an earlier H200 run; git history of benchmarks/results)."""
        return self.commit_buffer_tokens or 4 * self.batch_tokens

    def resolved_commit_workers(self) -> int:
        """`commit_workers`, or the default for this host (`aerie.extract.commit.default_workers`)."""
        if self.commit_workers is not None:
            return self.commit_workers
        from aerie.extract.commit import default_workers  # torch: only when extracting

        return default_workers(self.num_servers)


def server_quantization_problem(cfg: ExtractConfig, server_backend: str) -> str | None:
    """Why `quantize_on_server` cannot run with this storage and server backend, or None. Checked where a
    config is loaded (ExtractConfig with the reference server assumed, PipelineConfig with its own server)
    and again when the stage starts (a `model_copy` skips validation)."""
    if not cfg.quantize_on_server:
        return None
    if cfg.storage_dtype != "fp8":
        return (
            f"extract.quantize_on_server=true needs extract.storage_dtype 'fp8', not {cfg.storage_dtype!r}: "
            "fp8 dumps written into bf16 shards would carry fp8's rounding (set storage_dtype: fp8, or leave "
            "quantize_on_server false)"
        )
    if server_backend != "reference":
        return (
            f"extract.quantize_on_server=true needs server.backend 'reference', not {server_backend!r}: "
            "only the reference server quantizes its dumps (--dump-dtype fp8); the SGLang dump plugin "
            "writes the model dtype (leave quantize_on_server false, the client quantizes)"
        )
    return None
