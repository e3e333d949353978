"""Failure notifications as code: a webhook block and an automation on crashed deployment runs.

A failed run posts its own alert, from the pipeline flow's hook (naming the stage and the error). The
automation lives on the Prefect server and covers what no hook can: a run whose process died (the
worker killed, the machine gone), which the server marks Crashed. It reacts to deployment runs only
(tag `aerie`), not to their subflows, so one crash posts once. Apply it once per server:

    python -m deployments.notifications --webhook-url "$AERIE_WEBHOOK_URL"
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import cast
from uuid import UUID

from prefect.automations import Automation
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

BLOCK_NAME = "aerie-failures"
AUTOMATION_NAME = "aerie-run-failed"
FAILED_EVENTS = {"prefect.flow-run.Crashed"}


def save_webhook_block(url: str) -> UUID:
    """A Slack-compatible webhook block; the URL is stored as a secret field, never shown in the UI."""
    block = CustomWebhookNotificationBlock(
        name=BLOCK_NAME,
        url="{{ webhook_url }}",
        json_data={"text": "{{ subject }}\n{{ body }}"},
        secrets={"webhook_url": url},
    )
    return cast(UUID, block.save(BLOCK_NAME, overwrite=True))


def failure_automation(block_id: UUID) -> Automation:
    return Automation(
        name=AUTOMATION_NAME,
        description="An aerie deployment run crashed (its process died).",
        trigger=EventTrigger(
            posture=Posture.Reactive,
            expect=FAILED_EVENTS,
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=[
                {"prefect.resource.role": "tag", "prefect.resource.id": "prefect.tag.aerie"},
                {"prefect.resource.role": "deployment"},
            ],
            threshold=1,
            within=0,
        ),
        actions=[
            SendNotification(
                block_document_id=block_id,
                subject="aerie: {{ flow_run.name }} is {{ flow_run.state.name }}",
                body="{{ flow.name }}/{{ flow_run.name }}: {{ flow_run.state.message }}",
            )
        ],
    )


def apply(url: str) -> UUID:
    """Create or replace the block and the automation; returns the automation id."""
    block_id = save_webhook_block(url)
    with contextlib.suppress(ValueError):  # Prefect raises ValueError when no automation has that name
        cast(Automation, Automation.read(name=AUTOMATION_NAME)).delete()
    created = cast(Automation, failure_automation(block_id).create())
    return cast(UUID, created.id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--webhook-url", default=os.environ.get("AERIE_WEBHOOK_URL"), help="Slack-compatible URL"
    )
    args = parser.parse_args()
    if not args.webhook_url:
        parser.error("--webhook-url or AERIE_WEBHOOK_URL is required")
    print(f"automation {apply(args.webhook_url)} notifies on {', '.join(sorted(FAILED_EVENTS))}")


if __name__ == "__main__":
    main()
