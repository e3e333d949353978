"""Failure notifications as code: a webhook block and two automations on aerie's deployment runs.

A failed run posts its own alert, from the pipeline flow's hook (naming the stage and the error). The
automations live on the Prefect server and cover what no hook can, a run whose process died (the
worker killed, the machine gone):

- `aerie-run-unresponsive` marks such a run Crashed. A flow run's process sends a heartbeat event
  every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (prefect.yaml's pools set 60; Prefect's default is
  180) until its run ends; an aerie deployment run that sends none for `--unresponsive-after` seconds
  (300 by default: five missed heartbeats, so a late one on a loaded machine is not mistaken for a
  death) has no process left. Without it, the server shows a dead run RUNNING for ever.
- `aerie-run-failed` posts one alert when an aerie deployment run is Crashed. It reacts to deployment
  runs only (tag `aerie`), not to their subflows, so one crash posts once.

Apply them once per server:

    python -m deployments.notifications --webhook-url "$AERIE_WEBHOOK_URL"
"""

from __future__ import annotations

import argparse
import contextlib
import os
from datetime import timedelta
from typing import cast
from uuid import UUID

from prefect.automations import Automation
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

BLOCK_NAME = "aerie-failures"
AUTOMATION_NAME = "aerie-run-failed"
FAILED_EVENTS = {"prefect.flow-run.Crashed"}
UNRESPONSIVE_NAME = "aerie-run-unresponsive"
HEARTBEAT = "prefect.flow-run.heartbeat"
# What ends a run's heartbeats for a reason other than its death.
ENDED_EVENTS = {f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")}
UNRESPONSIVE_AFTER_S = 300
AERIE_DEPLOYMENT_RUN = [
    {"prefect.resource.role": "tag", "prefect.resource.id": "prefect.tag.aerie"},
    {"prefect.resource.role": "deployment"},
]


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
            match_related=AERIE_DEPLOYMENT_RUN,
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


def unresponsive_automation(after_s: float) -> Automation:
    """Crash an aerie deployment run that sent a heartbeat and then, for `after_s`, neither another
    one nor the event of its end."""
    return Automation(
        name=UNRESPONSIVE_NAME,
        description=f"An aerie deployment run sent no heartbeat for {after_s:.0f} s: its process died.",
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after={HEARTBEAT},
            expect={HEARTBEAT, *ENDED_EVENTS},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=AERIE_DEPLOYMENT_RUN,
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(seconds=after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {after_s:.0f} s: the run's process died (its worker or machine gone)",
            )
        ],
    )


def _replace(automation: Automation) -> UUID:
    with contextlib.suppress(ValueError):  # Prefect raises ValueError when no automation has that name
        cast(Automation, Automation.read(name=automation.name)).delete()
    return cast(UUID, cast(Automation, automation.create()).id)


def apply(url: str, unresponsive_after_s: float = UNRESPONSIVE_AFTER_S) -> tuple[UUID, UUID]:
    """Create or replace the block and both automations; returns the ids of the failure automation
    and of the unresponsive-run one."""
    failed = _replace(failure_automation(save_webhook_block(url)))
    return failed, _replace(unresponsive_automation(unresponsive_after_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--webhook-url", default=os.environ.get("AERIE_WEBHOOK_URL"), help="Slack-compatible URL"
    )
    parser.add_argument(
        "--unresponsive-after",
        type=float,
        default=UNRESPONSIVE_AFTER_S,
        metavar="S",
        help=f"seconds without a heartbeat before a run is marked Crashed (default {UNRESPONSIVE_AFTER_S})",
    )
    args = parser.parse_args()
    if not args.webhook_url:
        parser.error("--webhook-url or AERIE_WEBHOOK_URL is required")
    failed, unresponsive = apply(args.webhook_url, args.unresponsive_after)
    print(f"automation {failed} notifies on {', '.join(sorted(FAILED_EVENTS))}")
    print(
        f"automation {unresponsive} marks a run Crashed after {args.unresponsive_after:.0f} s without a heartbeat"
    )


if __name__ == "__main__":
    main()
