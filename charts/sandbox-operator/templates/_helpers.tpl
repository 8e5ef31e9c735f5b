{{- define "sandbox-operator.labels" -}}
app.kubernetes.io/name: sandbox-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* The chart's job pods: apart from the operator's (its Deployment selects those). */}}
{{- define "sandbox-operator.jobLabels" -}}
app.kubernetes.io/name: sandbox-operator-job
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sandbox-operator.gatewayLabels" -}}
app.kubernetes.io/name: sandbox-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sandbox-operator.mcpLabels" -}}
app.kubernetes.io/name: sandbox-mcp
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* priorityClassName, nodeSelector, tolerations, affinity of a pod spec, from
the values of one component (the operator's or .Values.gateway). */}}
{{- define "sandbox-operator.placement" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- /* The pod spec of the chart's jobs (files/chart-jobs.py in the operator's
image, restricted like the operator), up to the container's args. */}}
{{- define "sandbox-operator.jobPod" -}}
{{- $root := .root -}}
serviceAccountName: {{ .name }}
restartPolicy: Never
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  seccompProfile: {type: RuntimeDefault}
{{- with include "sandbox-operator.placement" $root.Values | trim }}{{ nindent 0 . }}{{ end }}
volumes:
  - name: scripts
    configMap: {name: {{ .name }}}
containers:
  - name: job
    image: "{{ $root.Values.image.repository }}:{{ $root.Values.image.tag }}"
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    env:
      - {name: PYTHONDONTWRITEBYTECODE, value: "1"}
      {{- with $root.Values.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities: {drop: [ALL]}
    resources:
      requests: {cpu: 10m, memory: 32Mi}
      limits: {cpu: 500m, memory: 128Mi}
    volumeMounts:
      - {name: scripts, mountPath: /scripts, readOnly: true}
    command: [python3]
{{- end -}}

{{- /* The peering object the operator's replicas share (ClusterKopfPeering names
are cluster-wide: the default carries the namespace too). */}}
{{- define "sandbox-operator.peeringName" -}}
{{- .Values.peering.name | default (printf "%s-%s" .Release.Name .Release.Namespace) | trunc 253 | trimSuffix "-" -}}
{{- end -}}

{{- /* Secrets access of one ServiceAccount (.name, in the release namespace): a
ClusterRole of .rules (a file under files/), bound in each of watchNamespaces, or
cluster-wide when the operator watches every namespace. So with watchNamespaces
set, the operator and the gateway cannot read a Secret outside them. */}}
{{- define "sandbox-operator.secretAccess" -}}
{{- $root := .root }}
{{- $role := printf "%s-secrets" .name }}
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {{ $role }}
  labels: {{- .labels | nindent 4 }}
rules:
{{ $root.Files.Get .rules }}
{{- range ($root.Values.watchNamespaces | default (list "")) }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ if . }}RoleBinding{{ else }}ClusterRoleBinding{{ end }}
metadata:
  name: {{ $role }}
  {{- if . }}
  namespace: {{ . }}
  {{- end }}
  labels: {{- $.labels | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ $role }}
subjects:
  - kind: ServiceAccount
    name: {{ $.name }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end -}}

{{- /* The operator's settings file (sandbox_operator/config.py): the values'
`settings` and what other values imply. */}}
{{- define "sandbox-operator.settings" -}}
{{- $derived := dict "operator_namespace" .Release.Namespace "watch_namespaces" .Values.watchNamespaces }}
{{- if .Values.gateway.enabled }}
{{- /* The agents admit the gateway (NetworkPolicy); status shows preview URLs. */}}
{{- $url := .Values.gateway.externalURL | default (printf "http://%s-gateway.%s.svc" .Release.Name .Release.Namespace) }}
{{- $_ := set $derived "gateway_pod_labels" (include "sandbox-operator.gatewayLabels" . | fromYaml) }}
{{- $_ := set $derived "gateway_url" $url }}
{{- if .Values.gateway.previewDomain }}{{- $_ := set $derived "preview_domain" .Values.gateway.previewDomain }}{{- end }}
{{- end }}
{{- if .Values.checkpointd.enabled }}
{{- /* Where the operator finds checkpointd (pauseMode Memory). */}}
{{- $_ := set $derived "checkpointd_namespace" .Values.checkpointd.namespace }}
{{- $_ := set $derived "checkpointd_port" .Values.checkpointd.port }}
{{- end }}
{{- toYaml (merge $derived .Values.settings) }}
{{- end -}}
