"""The run: raw records through the worker's pure stages, with record time as the clock, into the fleet.

``simulate`` feeds each record the window holds to ``ParseCore`` (fault events), the events to the
``Aggregator`` (incidents, recoveries, fabric signals; ticks every ``tick_interval_s`` of record
time), and those to the simulated actuator (``pipeline.replay.fleet``). The result is a
``pipeline.replay.outcome.Simulation``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeline.aggregate.aggregator import Aggregator
from pipeline.aggregate.state import NodeState
from pipeline.detection.parse_core import ParseCore
from pipeline.replay.config import ReplayConfig, catalog_in_force
from pipeline.replay.fleet import ReplayActuator
from pipeline.replay.outcome import Simulation
from pipeline.replay.window import RawLog, Window
from schemas.records import FabricSignal, NodeIncident, NodeRecovered


def simulate(records: Iterable[RawLog], config: ReplayConfig, window: Window) -> Simulation:
    """Replay ``records`` (in timestamp order, each node's in offset order) through one policy."""
    from pipeline.detection.detector import Detector

    records = list(records)
    sim = Simulation()
    seen_nodes = {_node_of(r) for r in records if window.holds(r.timestamp)} - {None}
    if config.fleet_size:
        sim.fleet_size, sim.fleet_source = config.fleet_size, "given"
    elif config.fleet_labels:
        sim.fleet_size, sim.fleet_source = len(config.fleet_labels), "GPU nodes in the cluster"
    else:
        sim.fleet_size, sim.fleet_source = max(1, len(seen_nodes)), "nodes seen in the history"
    with catalog_in_force(config.catalog_overrides) as catalog:
        core = ParseCore(config.topics, config.parse, detector_factory=lambda: Detector(catalog))
        aggregator = Aggregator(config.aggregation, catalog)
        actuator = ReplayActuator(config, sim, sim.fleet_size)
        states: dict[str, NodeState] = {}
        next_tick: float | None = None
        now = window.since

        def apply(events: Iterable[Any], at: float) -> None:
            for event in events:
                sim.events += 1
                state = states.get(event.node) or aggregator.new_state(event.node)
                signals: list[FabricSignal] = []
                states[event.node], outputs = aggregator.step(state, event, at, signals=signals)
                route(outputs, at)
                for signal in signals:
                    actuator.fabric(signal, at)

        def route(outputs: Iterable[NodeIncident | NodeRecovered], at: float) -> None:
            for out in outputs:
                if isinstance(out, NodeIncident):
                    actuator.incident(out, at)
                else:
                    actuator.recovered(out, at)

        for rec in records:
            if not window.holds(rec.timestamp):
                sim.outside_window += 1
                continue
            sim.records += 1
            now = max(now, rec.timestamp / 1000)
            sim.first_ts = now if sim.first_ts is None else sim.first_ts
            sim.last_ts = now
            # The worker's timer: quiet periods are checked every tick_interval_s (here, of record time).
            if next_tick is None:
                next_tick = now + config.tick_interval_s
            while next_tick <= now:
                for name, state in list(states.items()):
                    if state.has_transient():
                        states[name], outputs = aggregator.tick(state, next_tick)
                        route(outputs, next_tick)
                next_tick += config.tick_interval_s
            result = core.process([rec], now, topic=rec.topic)
            sim.dead_letters += len(result.dead_letters)
            apply(result.events, now)
        apply(core.detector.flush(), now)  # what the detector still holds for folding
    return sim


def _node_of(rec: RawLog) -> str | None:
    return rec.key.decode("utf-8", "replace") if rec.key else None

