"""Parse agent: hosts the batch parse stage (``pipeline.detection.parse_stage``) as a service of the Faust app.

Not a per-event Faust agent on purpose: see ``pipeline.detection.parse_stage`` for why (speed), and how it keeps
Faust's guarantees (commit only after outputs are acknowledged).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.detection.parse_stage import ParseStage

if TYPE_CHECKING:
    from pipeline.app import XidflowApp


def register(xapp: XidflowApp) -> ParseStage:
    """Attach a parse stage (consumer group ``<app_id>-parse``) to the app; returns it."""
    from pipeline.app import ParseService, parse_group_id

    stage = ParseStage(
        xapp.bootstrap,
        group_id=parse_group_id(xapp.settings.app_id),
        topics=xapp.topics,
        settings=xapp.parse,
        client_id=f"{xapp.settings.app_id}-parse",
        group=xapp.group,
    )

    class _HostedParse(ParseService):
        def __init__(self, **kwargs: object) -> None:
            super().__init__(stage, **kwargs)

        async def on_start(self) -> None:
            # Faust starts app services once the worker is ready, even when a stop signal came
            # meanwhile; a stage started then would join its group after the app stopped it.
            if xapp.app.should_stop:
                return
            await super().on_start()

    xapp.app.service(_HostedParse)
    return stage
