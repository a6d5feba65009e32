"""The actuator: turns NodeIncidents and third-party rescue requests into Kubernetes effects.

One responsibility per module, in the style of draino/kopf:

- ``settings``   ActuatorSettings (``XIDFLOW_ACTUATOR_*``)
- ``policy``     RescuePolicy / WarmStandbyPolicy models, YAML and CRD loading, rule matching (pure)
- ``problems``   problem class, condition type and Event reason of an incident (pure)
- ``ownership``  the ledger annotation: what xidflow applied, per incident and action (pure)
- ``plan``       incident + rule + node state -> ordered steps (pure)
- ``kube``       every Kubernetes API call, sync client run in a thread pool
- ``effects``    the effects themselves (cordon, taint, condition, Event, drain, reboot, ...)
- ``breaker``    circuit breaker and cluster-wide drain slots, state in ConfigMaps
- ``audit``      RemediationRecords to ``gpu.remediation.audit`` (+ notifier when present)
- ``engine``     runs a plan step by step with claims, ledger and audit
- ``consumer``   the aiokafka consumer group: per-node order, concurrency across nodes, safe commits
"""
