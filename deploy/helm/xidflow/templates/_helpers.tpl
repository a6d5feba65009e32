{{/* Names */}}
{{- define "xidflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "xidflow.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>", for (list $ "component") */}}
{{- define "xidflow.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "xidflow.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "xidflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "xidflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: xidflow
{{- end -}}

{{/* Selector labels of one component: (list $ "component") */}}
{{- define "xidflow.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "xidflow.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Labels of one component's pods: its selector labels and part-of, by which the actuator's drain knows
     xidflow's own pods and leaves them alone (pipeline/actuator/actions/drain.py, own_pods). (list $ "component") */}}
{{- define "xidflow.podLabels" -}}
{{ include "xidflow.selectorLabels" . }}
app.kubernetes.io/part-of: xidflow
{{- end -}}

{{/* Affinity of a control component (worker, actuator, loki-tail): off the GPU nodes (gpuNodeSelector) as
     avoidGpuNodes says, plus the component's own `affinity`, each of whose keys (nodeAffinity, podAffinity,
     podAntiAffinity) replaces the default one. (list $ componentValues defaults) */}}
{{- define "xidflow.controlAffinity" -}}
{{- $root := index . 0 -}}
{{- $own := (index . 1).affinity | default dict -}}
{{- $aff := deepCopy (index . 2) -}}
{{- $avoid := $root.Values.avoidGpuNodes -}}
{{- if and $avoid $root.Values.gpuNodeSelector -}}
{{- /* A GPU node carries every label of gpuNodeSelector: a node lacking any one of them is not one. */ -}}
{{- $terms := list -}}
{{- range $k, $val := $root.Values.gpuNodeSelector -}}
{{- $terms = append $terms (dict "matchExpressions" (list (dict "key" $k "operator" "NotIn" "values" (list $val)))) -}}
{{- end -}}
{{- if eq $avoid "required" -}}
{{- $_ := set $aff "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" $terms)) -}}
{{- else if eq $avoid "preferred" -}}
{{- $prefs := list -}}
{{- range $terms -}}
{{- $prefs = append $prefs (dict "weight" 100 "preference" .) -}}
{{- end -}}
{{- $_ := set $aff "nodeAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" $prefs) -}}
{{- else -}}
{{- fail (printf "avoidGpuNodes: %q is not required, preferred or empty" $avoid) -}}
{{- end -}}
{{- end -}}
{{- range $k, $val := $own -}}
{{- $_ := set $aff $k $val -}}
{{- end -}}
{{- if $aff -}}
affinity: {{- toYaml $aff | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* Tolerations of a control component: xidflow's own quarantine taint when its effect is NoExecute (a
     quarantine must never make Kubernetes evict xidflow itself from a node it runs on), then the component's
     own. (list $ componentValues) */}}
{{- define "xidflow.controlTolerations" -}}
{{- $root := index . 0 -}}
{{- $own := (index . 1).tolerations | default list -}}
tolerations:
  - key: {{ $root.Values.actuator.taint.key }}
    operator: Exists
    effect: NoExecute
{{- with $own }}
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "xidflow.componentLabels" -}}
{{ include "xidflow.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "xidflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Pod annotations: Prometheus scraping plus the component's own. (list $ componentValues) */}}
{{- define "xidflow.podAnnotations" -}}
{{- $root := index . 0 -}}
{{- $own := index . 1 -}}
{{- if $root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ $root.Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with $own }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Environment shared by every xidflow container, then the global and component `env` maps. */}}
{{- define "xidflow.env" -}}
{{- $root := index . 0 -}}
{{- $own := index . 1 -}}
- name: KAFKA_BOOTSTRAP_SERVERS
  value: {{ $root.Values.kafka.bootstrapServers | quote }}
- name: XIDFLOW_TOPIC_PREFIX
  value: {{ $root.Values.kafka.topicPrefix | quote }}
{{- $t := $root.Values.kafka.topics }}
- name: XIDFLOW_TOPIC_LOGS_KERNEL
  value: {{ $t.logsKernel | quote }}
- name: XIDFLOW_TOPIC_LOGS_PODS
  value: {{ $t.logsPods | quote }}
- name: XIDFLOW_TOPIC_HEALTH_CHECKS
  value: {{ $t.healthChecks | quote }}
- name: XIDFLOW_TOPIC_DEADLETTER
  value: {{ $t.deadletter | quote }}
- name: XIDFLOW_TOPIC_FAULT_EVENTS
  value: {{ $t.faultEvents | quote }}
- name: XIDFLOW_TOPIC_INCIDENTS
  value: {{ $t.incidents | quote }}
- name: XIDFLOW_TOPIC_FABRIC_SIGNALS
  value: {{ $t.fabricSignals | quote }}
- name: XIDFLOW_TOPIC_REMEDIATION_AUDIT
  value: {{ $t.remediationAudit | quote }}
- name: XIDFLOW_TOPIC_REMEDIATION_REQUESTS
  value: {{ $t.remediationRequests | quote }}
- name: XIDFLOW_METRICS_PORT
  value: {{ $root.Values.metrics.port | quote }}
{{ include "xidflow.opsEnv" $root }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- range $k, $v := $root.Values.env }}
- name: {{ $k }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- range $k, $v := $own }}
- name: {{ $k }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- end -}}

{{- define "xidflow.metricsPort" -}}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end -}}

{{/* Labels that mark a pod as serving xidflow metrics (selected by the metrics Service). */}}
{{- define "xidflow.metricsLabel" -}}
xidflow.dev/metrics: "true"
{{- end -}}

{{- define "xidflow.apiSecretName" -}}
{{- default (include "xidflow.componentName" (list . "api-tokens")) .Values.actuator.api.existingSecret -}}
{{- end -}}

{{/* A label map as a selector string: k1=v1,k2=v2 (sorted). */}}
{{- define "xidflow.labelSelector" -}}
{{- $parts := list -}}
{{- range $k, $v := . -}}
{{- $parts = append $parts (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}

{{/* ---- Kafka security (issue 12): env, volumes and mounts of one component ------------------------
     Each takes (list $ "<component key in kafka.security.sasl.users>" <component values>). Secrets are
     mounted as files; the process reads them through KAFKA_*_FILE variables. */}}
{{- define "xidflow.kafkaTlsOn" -}}
{{- if has .Values.kafka.security.protocol (list "SSL" "SASL_SSL") }}true{{ end -}}
{{- end -}}

{{- define "xidflow.kafkaPasswordUser" -}}
{{- $root := index . 0 -}}
{{- $sasl := $root.Values.kafka.security.sasl -}}
{{- if and (hasPrefix "SASL_" $root.Values.kafka.security.protocol) (has $sasl.mechanism (list "PLAIN" "SCRAM-SHA-256" "SCRAM-SHA-512")) }}true{{ end -}}
{{- end -}}

{{- define "xidflow.signingSecretName" -}}
{{- default (include "xidflow.componentName" (list . "signing")) .Values.signing.existingSecret -}}
{{- end -}}

{{- define "xidflow.kafkaEnv" -}}
{{- $root := index . 0 -}}
{{- $c := index . 1 -}}
{{- $own := index . 2 -}}
{{- $sec := $root.Values.kafka.security -}}
{{- $sasl := $sec.sasl -}}
- name: KAFKA_SECURITY_PROTOCOL
  value: {{ $sec.protocol | quote }}
{{- with $sasl.mechanism }}{{/* missing with SASL_*: the process refuses to start, naming KAFKA_SASL_MECHANISM */}}
- name: KAFKA_SASL_MECHANISM
  value: {{ . | quote }}
{{- end }}
{{- if include "xidflow.kafkaPasswordUser" (list $root) }}
{{- $u := index $sasl.users $c }}
- name: KAFKA_SASL_USERNAME
  value: {{ $u.username | quote }}
- name: KAFKA_SASL_PASSWORD_FILE
  value: /etc/xidflow/kafka-sasl/password
{{- if eq $c "actuator" }}
- name: KAFKA_API_SASL_USERNAME
  value: {{ $sasl.users.api.username | quote }}
- name: KAFKA_API_SASL_PASSWORD_FILE
  value: /etc/xidflow/kafka-sasl-api/password
{{- end }}
{{- else if and (hasPrefix "SASL_" $sec.protocol) (eq $sasl.mechanism "OAUTHBEARER") }}
{{- with $sasl.oauth.tokenFile }}
- name: KAFKA_SASL_OAUTH_TOKEN_FILE
  value: {{ . | quote }}
{{- end }}
{{- with $sasl.oauth.tokenCommand }}
- name: KAFKA_SASL_OAUTH_TOKEN_COMMAND
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if include "xidflow.kafkaTlsOn" $root }}
{{- if and $sec.tls.existingSecret $sec.tls.caKey }}
- name: KAFKA_SSL_CAFILE
  value: /etc/xidflow/kafka-tls/{{ $sec.tls.caKey }}
{{- end }}
{{- if and $sec.tls.existingSecret $sec.tls.certKey }}
- name: KAFKA_SSL_CERTFILE
  value: /etc/xidflow/kafka-tls/{{ $sec.tls.certKey }}
- name: KAFKA_SSL_KEYFILE
  value: /etc/xidflow/kafka-tls/{{ required "kafka.security.tls.keyKey is required with certKey" $sec.tls.keyKey }}
{{- end }}
- name: KAFKA_SSL_CHECK_HOSTNAME
  value: {{ $sec.tls.checkHostname | quote }}
{{- end }}
{{- if eq $c "actuator" }}
- name: XIDFLOW_SIGNING_KEY_FILE
  value: /etc/xidflow/signing/key
{{- end }}
{{- with $root.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with $own.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "xidflow.kafkaVolumes" -}}
{{- $root := index . 0 -}}
{{- $c := index . 1 -}}
{{- $own := index . 2 -}}
{{- $sec := $root.Values.kafka.security -}}
{{- if and (include "xidflow.kafkaTlsOn" $root) $sec.tls.existingSecret }}
- name: kafka-tls
  secret: {secretName: {{ $sec.tls.existingSecret | quote }}, defaultMode: 0440}
{{- end }}
{{- if include "xidflow.kafkaPasswordUser" (list $root) }}
{{- $u := index $sec.sasl.users $c }}
- name: kafka-sasl
  secret:
    secretName: {{ required (printf "kafka.security.sasl.users.%s.existingSecret is required with SASL %s" $c $sec.sasl.mechanism) $u.existingSecret | quote }}
    defaultMode: 0440
    items: [{key: {{ $u.passwordKey | quote }}, path: password}]
{{- if eq $c "actuator" }}
{{- $api := $sec.sasl.users.api }}
- name: kafka-sasl-api
  secret:
    secretName: {{ required "kafka.security.sasl.users.api.existingSecret is required with SASL" $api.existingSecret | quote }}
    defaultMode: 0440
    items: [{key: {{ $api.passwordKey | quote }}, path: password}]
{{- end }}
{{- end }}
{{- if eq $c "actuator" }}
- name: signing
  secret:
    secretName: {{ include "xidflow.signingSecretName" $root | quote }}
    defaultMode: 0440
    items: [{key: key, path: key}]
{{- end }}
{{- with $root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- with $own.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "xidflow.kafkaVolumeMounts" -}}
{{- $root := index . 0 -}}
{{- $c := index . 1 -}}
{{- $own := index . 2 -}}
{{- $sec := $root.Values.kafka.security -}}
{{- if and (include "xidflow.kafkaTlsOn" $root) $sec.tls.existingSecret }}
- {name: kafka-tls, mountPath: /etc/xidflow/kafka-tls, readOnly: true}
{{- end }}
{{- if include "xidflow.kafkaPasswordUser" (list $root) }}
- {name: kafka-sasl, mountPath: /etc/xidflow/kafka-sasl, readOnly: true}
{{- if eq $c "actuator" }}
- {name: kafka-sasl-api, mountPath: /etc/xidflow/kafka-sasl-api, readOnly: true}
{{- end }}
{{- end }}
{{- if eq $c "actuator" }}
- {name: signing, mountPath: /etc/xidflow/signing, readOnly: true}
{{- end }}
{{- with $root.Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- with $own.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Fluent Bit (librdkafka) properties merged into each kafka output when Kafka is secured. */}}
{{- define "xidflow.fluentBitKafkaSecurity" -}}
{{- $sec := .Values.kafka.security -}}
rdkafka.security.protocol: {{ lower $sec.protocol }}
{{- if include "xidflow.kafkaPasswordUser" (list .) }}
rdkafka.sasl.mechanisms: {{ $sec.sasl.mechanism }}
rdkafka.sasl.username: {{ $sec.sasl.users.fluentBit.username | quote }}
rdkafka.sasl.password: ${KAFKA_SASL_PASSWORD}
{{- end }}
{{- if include "xidflow.kafkaTlsOn" . }}
rdkafka.ssl.endpoint.identification.algorithm: {{ ternary "https" "none" $sec.tls.checkHostname }}
{{- if and $sec.tls.existingSecret $sec.tls.caKey }}
rdkafka.ssl.ca.location: /etc/xidflow/kafka-tls/{{ $sec.tls.caKey }}
{{- end }}
{{- if and $sec.tls.existingSecret $sec.tls.certKey }}
rdkafka.ssl.certificate.location: /etc/xidflow/kafka-tls/{{ $sec.tls.certKey }}
rdkafka.ssl.key.location: /etc/xidflow/kafka-tls/{{ $sec.tls.keyKey }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "xidflow.fluentBitKafkaEnv" -}}
{{- $sec := .Values.kafka.security -}}
{{- if include "xidflow.kafkaPasswordUser" (list .) }}
{{- $u := $sec.sasl.users.fluentBit }}
- name: KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.security.sasl.users.fluentBit.existingSecret is required with SASL" $u.existingSecret | quote }}
      key: {{ $u.passwordKey | quote }}
{{- end }}
{{- end -}}
