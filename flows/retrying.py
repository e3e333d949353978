"""Which task failures are worth a retry: transient trouble is, errors that fail the same way again
(a rejected key, a bad config, bad source data, a disk too small) are not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RetryCondition = Callable[[Any, Any, Any], bool]


def retry_unless(*permanent: type[BaseException]) -> RetryCondition:
    """A Prefect `retry_condition_fn` that retries any failure but those of the `permanent` types."""

    def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
        try:
            state.result()
        except permanent:
            return False
        except Exception:
            return True
        return True

    return worth_retrying
