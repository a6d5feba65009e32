"""Policy what-if replay, the pure core: raw log records in, what a policy would have done out.

``xidflow replay`` (``pipeline.commands.replay``) reads the retained raw topics and hands the records
here. Nothing is re-implemented: the records go through the worker's own pure stages and the
actuator's own decisions, with the records' timestamps as the clock, so debounce, quiet periods,
attempt caps and the breaker window behave as they would have:

1. ``ParseCore`` (adapters, prefilter, ``Detector`` with the catalog) -> fault events;
2. ``Aggregator.step`` / ``Aggregator.tick`` (ticks every ``tick_interval_s`` of record time, as the
   worker's timer asks) -> incidents and recoveries;
3. ``plan_incident`` (policy selection, the ``quarantine`` macro, opt-out, attempt cap, escalation)
   -> steps; ``decide_admissions`` (the circuit breaker) before the first step that takes a node out
   of scheduling; ``plan_recovery_for`` on a recovery.
4. the aggregation's fabric signals -> ``pipeline.aggregate.sharedparts.observe`` per topology label value the
   policy names (``sharedParts``), with the cluster's node labels: the shared parts that would have
   been blamed instead of their nodes.

The actuator's effects are simulated on an in-memory Node per node (its ledger annotation, cordon and
taints): node-object actions (``Kind.NODE``) apply their own pure ``change``; every other action is
recorded as done and owns its ``effect_key``, as the effector records it. Actions are handled through
the registry (``pipeline.actuator.actions``), so a new action shows up without a change here.

Assumptions, stated in the report: every step succeeds at once (waits, drains and reboots take no
time); the fleet starts the window with nothing quarantined by xidflow; a tripped breaker stays open
(only a person resets it).

The modules, in the order of the data: ``window`` (the records read and the time window),
``config`` (one policy's what-if and the catalog in force), ``run`` (``simulate``: stages 1, 2 and
the ticks), ``fleet`` (the actuator's decisions on simulated nodes: stages 3 and 4), ``outcome``
(what one policy would have done) and ``report`` (the report's sections). Importers name the module
that defines a name; this package re-exports nothing.
"""
