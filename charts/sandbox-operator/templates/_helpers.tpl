{{- define "sandbox-operator.labels" -}}
app.kubernetes.io/name: sandbox-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
