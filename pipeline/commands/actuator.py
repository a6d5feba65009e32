"""``xidflow actuator``: run one actuator replica (a member of the consumer group)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import click


@click.command("actuator")
@click.option("--dry-run", is_flag=True, default=None, help="Audit every decision as dry-run; mutate nothing.")
@click.option("--manual-only", is_flag=True, default=None, help="Automatic policies off; only API requests act.")
@click.option("--policy-file", type=click.Path(exists=True, dir_okay=False), default=None, help="Policy YAML.")
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="Default: in-cluster service account.")
@click.option("--log-level", default="INFO", show_default=True)
@click.option("--api/--no-api", "serve_api", default=None,
              help="Serve the decision API (XIDFLOW_API_*); default: when API tokens are configured.")
def actuator(
    dry_run: bool | None,
    manual_only: bool | None,
    policy_file: str | None,
    kubeconfig: str | None,
    log_level: str,
    serve_api: bool | None,
) -> None:
    """Consume incidents and rescue requests and remediate nodes (settings: XIDFLOW_ACTUATOR_*)."""
    from pydantic import ValidationError

    from pipeline.actuator.api import ApiSettings, run_api
    from pipeline.actuator.app import Actuator
    from pipeline.actuator.policy import PolicyError, load_yaml_file
    from pipeline.actuator.settings import ActuatorSettings
    from pipeline.metrics import serve_metrics
    from pipeline.settings import KafkaSettings, describe_validation_error

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    overrides = {
        k: v
        for k, v in {"dry_run": dry_run, "manual_only": manual_only, "policy_file": policy_file}.items()
        if v is not None
    }
    try:
        settings = ActuatorSettings(**overrides)
        api_settings = ApiSettings()
        if settings.policy_file:
            load_yaml_file(settings.policy_file)  # refuse a bad policy before touching anything
    except ValidationError as exc:
        raise click.ClickException(describe_validation_error(exc)) from None
    except PolicyError as exc:
        raise click.ClickException(f"invalid policy file {settings.policy_file}: {exc}") from exc
    if serve_api is None:
        serve_api = bool(api_settings.tokens or api_settings.token_file)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        serve_metrics()
        api_task = None
        if serve_api:
            api_task = asyncio.create_task(run_api(api_settings, KafkaSettings().bootstrap_servers))
        try:
            await Actuator(settings, kubeconfig=kubeconfig).run_forever(stop)
        finally:
            if api_task is not None:
                api_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await api_task

    asyncio.run(main())
