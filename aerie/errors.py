"""aerie's one error tree.

Every error aerie raises on purpose is an ``AerieError``; lower-level errors (httpx, botocore, OSError,
pydantic) are translated at the module boundary with ``raise ... from exc`` so callers catch one tree
(a refused write, a full disk most often, becomes the stage's own error naming the file and the room left
there: ``aerie.diskspace.writing``)::

    AerieError
    ├── ConfigError                 a bad field, value, override or preset name
    │   └── CacheDirError           aerie's cache (AERIE_CACHE_DIR, default ~/.cache/aerie) cannot be written
    ├── StoreError                  the artifact store (local dir or S3)
    │   ├── ObjectNotFoundError     no object under that key
    │   └── IntegrityError          a checksum that does not match (corrupted or partial object)
    ├── DataError                   source datasets and the corpus
    │   ├── SourceNotFoundError     a missing file, directory or data package
    │   └── SchemaError             a dataset whose columns or fields do not match its spec
    ├── TargetError                 resolving or converting the target model
    ├── EndpointError               the generation endpoint (OpenRouter / OpenAI-compatible)
    │   ├── EndpointAuthError       401/403: the key was rejected (fix the key; never retried)
    │   ├── EndpointRequestError    400/404: the request itself is wrong (fix the spec; never retried)
    │   ├── EndpointUnreachableError   the check before generation found no endpoint answering there
    │   └── RequestFailedError      one conversation failed for good this run (retries exhausted, or
    │                               its prompt rejected); the dataset goes on, the next run retries it
    ├── ServerError                 a model server's lifecycle
    │   ├── ServerLaunchError       refused before any wait (wrong interpreter, missing module, bad spec)
    │   │   └── PortInUseError      something already answers on the port (a stale server)
    │   ├── ServerCrashedError      the process or container exited while starting or serving
    │   ├── ServerTimeoutError      not ready by the deadline (carries the last progress seen)
    │   └── ServerIdentityError     the server that answers is not the one launched (nonce mismatch)
    ├── ExtractionError             hidden-state extraction
    │   ├── PreflightError          not enough disk for the estimated bytes (says how much)
    │   └── CanaryError             the canary sample proved hidden states are wrong or missing
    ├── TrainingError               the drafter trainer
    ├── EvaluationError             speculative decoding, benchmarks, promotion
    ├── PlanError                   `aerie plan` refuses a run that cannot fit (says by how much)
    │   ├── NotEnoughDiskError      a filesystem too small for what the run writes there
    │   ├── GpuMemoryError          the target (or a training step) larger than the GPUs' memory
    │   └── ContextLengthError      a sequence length beyond the target's context
    └── BundleError                 an air-gapped bundle (`aerie bundle`): a wheel pip cannot fetch or
                                    build, a failed offline install, an installed environment that
                                    does not import

``Interrupted`` is a ``KeyboardInterrupt``, not an ``AerieError``: Ctrl-C stopped a stage, which kept
what it finished; its message is one line saying what is kept and how to resume.
"""

from __future__ import annotations


class AerieError(Exception):
    """Base of every error aerie raises on purpose."""


class ConfigError(AerieError, ValueError):
    """A bad config field, value, override or preset name."""


class CacheDirError(ConfigError):
    """aerie's cache folder cannot be created or written: the message names it and AERIE_CACHE_DIR."""


class StoreError(AerieError):
    """The artifact store failed."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """No object under that key."""


class IntegrityError(StoreError):
    """An object's checksum does not match what was recorded."""


class DataError(AerieError):
    """A source dataset or the corpus is unusable."""


class SourceNotFoundError(DataError, FileNotFoundError):
    """A dataset file, directory or data package is missing."""


class SchemaError(DataError):
    """A dataset's columns or fields do not match its spec."""


class TargetError(AerieError):
    """The target model cannot be resolved or converted."""


class EndpointError(AerieError):
    """The generation endpoint failed."""


class EndpointAuthError(EndpointError):
    """The endpoint rejected the API key (401/403)."""


class EndpointRequestError(EndpointError):
    """The endpoint rejected the request itself (400/404)."""


class EndpointUnreachableError(EndpointError):
    """Before any generation: nothing answers at the endpoint (refused, unreachable, silent)."""


class RequestFailedError(EndpointError):
    """One conversation's request failed for good in this run: retries exhausted, or the endpoint
    rejected that one prompt. The dataset goes on; the conversation is retried on the next run.
    `kind` names the last failure (`timeout`, `http_429`, `rejected`...), `attempts` how many were made."""

    def __init__(self, kind: str, message: str, attempts: int) -> None:
        super().__init__(message)
        self.kind, self.attempts = kind, attempts


class ServerError(AerieError):
    """A model server's lifecycle failed."""


class ServerLaunchError(ServerError):
    """The launch was refused before any wait."""


class PortInUseError(ServerLaunchError):
    """Something already answers on the port."""


class ServerCrashedError(ServerError):
    """The server process or container exited. `after_ready`: it had answered ready first (it died while
    serving, or during its canary), so it loaded once and a restart may well succeed; a crash on the
    way to ready is most often deterministic (a bad model, no memory) and is not retried in place."""

    def __init__(self, message: str, *, after_ready: bool = False) -> None:
        super().__init__(message)
        self.after_ready = after_ready


class ServerTimeoutError(ServerError, TimeoutError):
    """The server was not ready by its deadline."""


class ServerIdentityError(ServerError):
    """The server answering is not the one that was launched."""


class ExtractionError(AerieError):
    """Hidden-state extraction failed."""


class PreflightError(ExtractionError):
    """Not enough free space for the estimated bytes."""


class CanaryError(ExtractionError):
    """The canary sample proved the hidden states wrong or missing."""


class TrainingError(AerieError):
    """The drafter trainer failed."""


class EvaluationError(AerieError):
    """Evaluation, benchmarking or promotion failed."""


class PlanError(AerieError):
    """The plan shows the run cannot fit."""


class NotEnoughDiskError(PlanError):
    """A filesystem is smaller than what the run writes there."""


class GpuMemoryError(PlanError):
    """The target's weights, or a training step, do not fit the GPUs' memory at this parallelism."""


class ContextLengthError(PlanError):
    """A configured sequence length is beyond the target's context."""


class BundleError(AerieError):
    """Building or installing an air-gapped bundle failed (a wheel, the offline install, its check)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a stage; `str()` is one line: what is kept, and how to resume."""
