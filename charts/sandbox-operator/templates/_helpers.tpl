{{- define "sandbox-operator.labels" -}}
app.kubernetes.io/name: sandbox-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sandbox-operator.gatewayLabels" -}}
app.kubernetes.io/name: sandbox-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sandbox-operator.mcpLabels" -}}
app.kubernetes.io/name: sandbox-mcp
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
