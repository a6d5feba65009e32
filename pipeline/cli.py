"""The ``xidflow`` command line.

Subcommands are loaded lazily (click's LazyGroup pattern): ``xidflow classify`` must not pay for
importing Faust or the Kubernetes client. Each entry maps a command name to
``module:attribute`` of a click command that lives next to the code it drives.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

import click

from pipeline.runtime import startmarks

startmarks.mark("cli")  # the interpreter is up and click imported

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "local": ("pipeline.commands.local:local", "Start/stop the local Kafka broker and kube-apiserver."),
    "classify": ("pipeline.commands.classify:classify", "Classify kernel or pod log lines from a file."),
    "loki-tail": ("pipeline.commands.loki_tail:loki_tail", "Bridge a Loki tail query into Kafka."),
    "probe": ("pipeline.commands.probe:probe", "Run node-side NVML health checks on an interval."),
    "worker": ("pipeline.commands.worker:worker", "Run the Faust parse and aggregation worker."),
    "actuator": ("pipeline.commands.actuator:actuator", "Run the Kubernetes remediation consumer."),
    "status": ("pipeline.commands.status:status", "Show GPU nodes and what xidflow applied."),
    "reset": ("pipeline.commands.status:reset", "Remove what xidflow applied to nodes."),
    "breaker": ("pipeline.commands.status:breaker", "Show or reset the quarantine circuit breaker."),
    "bench": ("pipeline.commands.bench:bench", "Measure throughput and latency against a baseline."),
    "demo": ("pipeline.commands.demo:demo", "Run the end-to-end demo on the embedded default."),
    "replay": ("pipeline.commands.replay:replay", "What a candidate policy would have done on the retained logs."),
}


SERVICES = frozenset({"worker", "actuator"})
"""The long-lived services: their start runs without the cyclic garbage collector (``LazyGroup.get_command``)."""

_INVOKING, _GC_PAUSED = "xidflow.invoking", "xidflow.gc_paused"


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = SUBCOMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name, attr = entry[0].split(":")
        if cmd_name in SERVICES and ctx is not None and ctx.meta.get(_INVOKING) and gc.isenabled():
            # A service's start (a container restart after a crash, issue 22's failover_*_process) imports
            # and builds what lives as long as the process: the collector's dozens of young passes over
            # it free nothing and cost ~0.1 s of CPU before the partitions flow again. On again once the
            # service runs: ``gcpolicy.tune`` (with its thresholds), the supervisor after freezing what its
            # children share, and ``invoke`` whatever else happens (a refused setting, an in-process runner).
            # Only when the command runs: a caller that only looks the command up (its options, its help)
            # keeps its collector.
            gc.disable()
            ctx.meta[_GC_PAUSED] = True
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            raise click.ClickException(f"'{cmd_name}' is not available in this build ({module_name} missing)") from exc
        return getattr(module, attr)

    def invoke(self, ctx: click.Context) -> object:
        """Run the command; what escapes it is one clear sentence and a non-zero exit, not a traceback.

        Settings refused by their class name the environment variable; anything else names the
        error. ``XIDFLOW_DEBUG=1`` lets the traceback through.
        """
        ctx.meta[_INVOKING] = True
        try:
            return self._invoke(ctx)
        finally:
            if ctx.meta.pop(_GC_PAUSED, False):
                gc.enable()  # a service's start paused it (``get_command``)

    def _invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            if os.environ.get("XIDFLOW_DEBUG"):
                raise
            from pydantic import ValidationError
            from pydantic_settings import SettingsError

            if isinstance(exc, ValidationError):
                from pipeline.runtime.settings import describe_validation_error

                raise click.ClickException(describe_validation_error(exc)) from None
            if isinstance(exc, SettingsError):  # unparsable JSON in a variable; the value is not shown
                raise click.ClickException(f"invalid settings: {exc}") from None
            command = ctx.invoked_subcommand or "xidflow"
            raise click.ClickException(
                f"{command} failed: {type(exc).__name__}: {exc} (XIDFLOW_DEBUG=1 shows the traceback)"
            ) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing uses the static help texts so that `--help` imports nothing heavy.
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="xidflow")
def cli() -> None:
    """xidflow: find NVIDIA GPU faults in log streams and remediate the nodes on Kubernetes."""
    from pipeline.runtime.envcheck import warnings

    for line in warnings():  # an unknown XIDFLOW_* variable (a typo) would otherwise be ignored silently
        click.echo(line, err=True)


def main() -> None:
    sys.exit(cli(standalone_mode=True))


if __name__ == "__main__":
    main()
