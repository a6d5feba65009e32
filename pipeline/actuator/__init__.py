"""The actuator: turns NodeIncidents and third-party rescue requests into Kubernetes effects.

A level-triggered controller: Kafka records say what a node must go through, the node's ledger
keeps the flow, and whichever replica owns the node's partition drives it to the end. One
responsibility per module, in the style of draino/kopf:

- ``settings``    ActuatorSettings (``XIDFLOW_ACTUATOR_*``)
- ``actions/``    one module per action (traits + runner), registered in one registry
- ``policy``      RescuePolicy / WarmStandbyPolicy models, YAML and CRD loading, rule matching (pure)
- ``problems``    problem class, condition type and Event reason of an incident (pure)
- ``ownership``   the ledger annotation: open flows, leases, what xidflow applied and who (pure)
- ``nodeview``    what the actuator reads of a Node (pure)
- ``plan``        incident / request / recovery + rule + node state -> ordered steps (pure)
- ``kube``        every Kubernetes API call, sync client run in a thread pool
- ``nodestate``   conditional read-modify-write of a Node with its ledger
- ``effects``     node-object changes, conditions, Events, hook Jobs, standby helpers
- ``effector``    runs a group of steps (claims and renewed leases for long ones); dry-run swaps it
- ``breaker``     circuit breaker and cluster-wide drain slots, state in ConfigMaps
- ``audit``       RemediationRecords to ``gpu.remediation.audit`` (+ notifier when present)
- ``engine``      orchestration: record or ledger -> plan -> groups -> audit
- ``reconciler``  Node list+watch; resumes the open flows of the nodes this replica owns
- ``consumer``    the aiokafka consumer group: per-node order, concurrency across nodes, safe commits
"""
