{{/* Logging and liveness of every xidflow container (see values: logLevel, logFormat, health). */}}
{{- define "xidflow.opsEnv" -}}
- name: XIDFLOW_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: XIDFLOW_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: XIDFLOW_HEALTH_PORT
  value: {{ .Values.health.port | quote }}
{{- end -}}

{{- define "xidflow.healthPort" -}}
- name: health
  containerPort: {{ .Values.health.port }}
  protocol: TCP
{{- end -}}

{{/* Liveness: GET /livez is answered by the process's event loop (not /metrics, served by a thread). */}}
{{- define "xidflow.livenessProbe" -}}
livenessProbe:
  httpGet: {path: /livez, port: health}
  initialDelaySeconds: {{ .Values.health.initialDelaySeconds }}
  periodSeconds: {{ .Values.health.periodSeconds }}
  timeoutSeconds: {{ .Values.health.timeoutSeconds }}
  failureThreshold: {{ .Values.health.failureThreshold }}
{{- end -}}
