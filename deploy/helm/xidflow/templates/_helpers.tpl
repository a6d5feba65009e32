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
