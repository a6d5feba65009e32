"""``xidflow actuator``: run one actuator replica (a member of the consumer group)."""

from __future__ import annotations

import asyncio
import logging
import signal

import click


@click.command("actuator")
@click.option("--dry-run", is_flag=True, default=None, help="Audit every decision as dry-run; mutate nothing.")
@click.option("--manual-only", is_flag=True, default=None, help="Automatic policies off; only API requests act.")
@click.option("--policy-file", type=click.Path(exists=True, dir_okay=False), default=None, help="Policy YAML.")
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="Default: in-cluster service account.")
@click.option("--log-level", default="INFO", show_default=True)
def actuator(
    dry_run: bool | None, manual_only: bool | None, policy_file: str | None, kubeconfig: str | None, log_level: str
) -> None:
    """Consume incidents and rescue requests and remediate nodes (settings: XIDFLOW_ACTUATOR_*)."""
    from pipeline.actuator.app import Actuator
    from pipeline.actuator.settings import ActuatorSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    overrides = {
        k: v
        for k, v in {"dry_run": dry_run, "manual_only": manual_only, "policy_file": policy_file}.items()
        if v is not None
    }
    settings = ActuatorSettings(**overrides)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await Actuator(settings, kubeconfig=kubeconfig).run_forever(stop)

    asyncio.run(main())
