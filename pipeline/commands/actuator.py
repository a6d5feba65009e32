"""``xidflow actuator``: run one actuator replica (a member of the consumer group).

Start-up either serves everything that is configured or exits non-zero with one clear sentence:
bad settings, an unreadable token file or a port that cannot be bound stop the command before it
consumes anything. No token or setting value is ever echoed (they may be secrets).
"""

from __future__ import annotations

import asyncio
import signal

import click
from pydantic import ValidationError

from pipeline.runtime.logconfig import log_options


@click.command("actuator")
@click.option("--dry-run", is_flag=True, default=None, help="Audit every decision as dry-run; mutate nothing.")
@click.option("--manual-only", is_flag=True, default=None, help="Automatic policies off; only API requests act.")
@click.option("--policy-file", type=click.Path(exists=True, dir_okay=False), default=None, help="Policy YAML.")
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="Default: in-cluster service account.")
@log_options
@click.option("--api/--no-api", "serve_api", default=None,
              help="Serve the decision API (XIDFLOW_API_*); default: when API tokens or a token file are configured.")
@click.option("--supervise/--no-supervise", default=None,
              help="Run the work in a child that a warm supervisor replaces at once when it dies "
                   "(pipeline.runtime.supervisor). [env XIDFLOW_SUPERVISOR_ENABLED, default on]")
def actuator(
    dry_run: bool | None,
    manual_only: bool | None,
    policy_file: str | None,
    kubeconfig: str | None,
    serve_api: bool | None,
    supervise: bool | None,
) -> None:
    """Consume incidents and rescue requests and remediate nodes (settings: XIDFLOW_ACTUATOR_*)."""
    from pipeline.runtime.startmarks import mark

    mark("command")
    from pydantic_settings import SettingsError

    from pipeline.actuator import fleetmetrics
    from pipeline.actuator.api.settings import ApiSettings  # the aiohttp application only when served
    from pipeline.actuator.app import Actuator
    from pipeline.actuator.jobtemplates import JobTemplateError, check_operator_templates
    from pipeline.actuator.policy import PolicyError, load_yaml_file
    from pipeline.actuator.settings import ActuatorSettings
    from pipeline.commands.status import resolve_kubeconfig, sentences
    from pipeline.detection.catalog import Catalog, CatalogError
    from pipeline.runtime import gcpolicy
    from pipeline.runtime.gcpolicy import GcSettings
    from pipeline.runtime.heartbeat import with_liveness
    from pipeline.runtime.metrics import serve_metrics
    from pipeline.runtime.settings import KafkaSettings, describe_validation_error

    overrides = {
        k: v
        for k, v in {"dry_run": dry_run, "manual_only": manual_only, "policy_file": policy_file}.items()
        if v is not None
    }
    try:
        settings = ActuatorSettings(**overrides)
        api_settings = ApiSettings()
        gc_settings = GcSettings()
    except ValidationError as exc:
        raise click.ClickException(describe_validation_error(exc)) from None
    except SettingsError as exc:
        # pydantic-settings could not decode a JSON value (e.g. XIDFLOW_API_TOKENS); its message names the field.
        raise click.ClickException(f"invalid settings: {exc}; expected JSON") from None
    try:
        Catalog.configured()  # condition types and policy codes follow the operator's catalog overrides
    except CatalogError as exc:
        raise click.ClickException(f"invalid catalog override: {exc}") from None
    if settings.policy_file:
        try:
            load_yaml_file(settings.policy_file)  # refuse a bad policy before touching anything
        except (PolicyError, OSError) as exc:
            why = f"cannot be read: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
            raise click.ClickException(
                f"invalid policy file {settings.policy_file} (XIDFLOW_ACTUATOR_POLICY_FILE / --policy-file): {why}"
            ) from None
    try:
        check_operator_templates(settings)
    except JobTemplateError as exc:
        raise click.ClickException(str(exc)) from None
    if serve_api is None:
        serve_api = bool(api_settings.tokens or api_settings.token_file)
    tokens = None
    api_errors: tuple[type[Exception], ...] = ()
    if serve_api:
        from pipeline.actuator.api import ApiStartError, check_tokens, start_api

        api_errors = (ApiStartError,)
        try:
            tokens = check_tokens(api_settings)  # an unreadable token file stops us here, before anything connects
        except ApiStartError as exc:
            raise click.ClickException(str(exc)) from None
    kubeconfig = resolve_kubeconfig(kubeconfig, None)  # no kubeconfig: a sentence, not a traceback
    mark("settings")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        replica = Actuator(settings, kubeconfig=kubeconfig)
        mark("built")
        serve_metrics(component="actuator", values=fleetmetrics.label_values(replica.webhook_names()))
        running = None
        if serve_api:
            try:
                # Listening before consuming: a port that cannot be bound ends the command, not the API alone.
                running = await start_api(
                    api_settings, replica.kube, KafkaSettings().bootstrap_servers, tokens=tokens
                )
            except BaseException:
                replica.kube.close()
                raise
        try:
            await with_liveness(replica.run_forever(stop))
        finally:
            if running is not None:
                await running.stop()

    def work() -> None:
        """The replica itself: the loop, the clients and their threads are made here, after the fork."""
        mark("work")
        gcpolicy.tune(gc_settings)  # the collector runs far less often: its CPU is a burst's latency
        with sentences():  # the API server or Kafka down at start: a sentence and exit 1 (the pod restarts)
            try:
                asyncio.run(main())
            except api_errors as exc:
                raise click.ClickException(str(exc)) from None

    from pipeline.runtime import supervisor
    supervisor.preload(ACTUATOR_MODULES)
    mark("preloaded")
    raise SystemExit(supervisor.supervise(work, "actuator", supervise))


ACTUATOR_MODULES = (
    # Imported by the replica only once it runs: loaded by the supervisor before the fork, so a
    # replacement child does not pay for them (pipeline.runtime.supervisor). Not the Kubernetes client's
    # generated API modules (CoreV1Api and the like: ~1.2 s of CPU building pydantic models): no child
    # needs them before its first records (pipeline.actuator.kube builds them at first use, a drain's
    # pod calls or a policy CRD), and importing them here delayed a restarted container's first child.
    "aiokafka",
    "kubernetes.client",
    "kubernetes.watch",
    "pipeline.actuator.notify",
    "pipeline.actuator.engine",
    "pipeline.actuator.effector",
    "pipeline.actuator.consumer",
    "pipeline.actuator.reconciler",
)
