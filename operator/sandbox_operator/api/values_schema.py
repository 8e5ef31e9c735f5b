"""charts/sandbox-operator/values.schema.json: every value of the chart, so that
`helm install`, `helm upgrade` and `helm template` refuse a wrong one with the
path and the reason. The operator's and the gateway's `settings` come from
their models (config.py, gateway/config.py), like the CRDs come from api/."""

from __future__ import annotations

import json
from typing import Any

from sandbox_operator.config import Settings
from sandbox_operator.gateway.config import GatewaySettings

JSON = dict[str, Any]

PATH = "charts/sandbox-operator/values.schema.json"

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_QUANTITY = {
    "description": 'A Kubernetes quantity such as 0.5, "500m", "512Mi" or "2Gi".',
    "anyOf": [
        {"type": "number", "minimum": 0},
        {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"},
    ],
}
_DURATION = {
    "type": "string",
    "description": 'A Prometheus duration such as "30s" or "1m"; empty: the default.',
    "pattern": r"^$|^([0-9]+(ms|s|m|h))+$",
}


def _obj(description: str, properties: JSON, **extra: Any) -> JSON:
    """An object that refuses keys it does not know (a typo must not pass)."""
    return {
        "type": "object",
        "description": description,
        "additionalProperties": False,
        "properties": properties,
        **extra,
    }


def _string_map(description: str) -> JSON:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {"type": "string"},
    }


def _resource_list(description: str) -> JSON:
    return {"type": "object", "description": description, "additionalProperties": _QUANTITY}


def _service(description: str) -> JSON:
    return _obj(
        description,
        {
            "type": {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        },
    )


def _placement(component: str) -> JSON:
    """Scheduling and sizing values, the same for the operator and the gateway."""
    return {
        "resources": _obj(
            f"Requests and limits of the {component} container.",
            {
                "requests": _resource_list("cpu, memory, ephemeral-storage, ..."),
                "limits": _resource_list("cpu, memory, ephemeral-storage, ..."),
            },
        ),
        "priorityClassName": {
            "type": "string",
            "description": f"PriorityClass of the {component} pods; empty: none.",
            "maxLength": 253,
            "pattern": f"^$|{_DNS_SUBDOMAIN}",
        },
        "nodeSelector": _string_map(f"Node labels the {component} pods require."),
        "tolerations": {
            "type": "array",
            "description": f"Taints the {component} pods tolerate.",
            "items": _obj(
                "A toleration (core/v1 Toleration).",
                {
                    "key": {"type": "string"},
                    "operator": {"type": "string", "enum": ["Exists", "Equal"]},
                    "value": {"type": "string"},
                    "effect": {
                        "type": "string",
                        "enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"],
                    },
                    "tolerationSeconds": {"type": "integer"},
                },
            ),
        },
        "affinity": _obj(
            f"Affinity of the {component} pods (core/v1 Affinity).",
            {
                "nodeAffinity": {"type": "object"},
                "podAffinity": {"type": "object"},
                "podAntiAffinity": {"type": "object"},
            },
        ),
    }


def _inline(node: Any, defs: JSON) -> Any:
    """A model's JSON schema with its $refs resolved in place and pydantic's
    titles dropped: the subtree stands alone inside the chart's schema."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(defs[node["$ref"].rsplit("/", 1)[1]], defs)
        return {
            key: _inline(value, defs)
            for key, value in node.items()
            if key not in ("title", "$defs", "x-kubernetes-int-or-string")
        }
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    return node


def _model(model: type[Settings] | type[GatewaySettings], description: str) -> JSON:
    schema = model.model_json_schema(mode="validation")
    return {**_inline(schema, schema.get("$defs", {})), "description": description}


def build() -> JSON:
    gateway = _obj(
        "sandbox-gateway: authenticated access to sandboxes (docs/gateway-and-access.md).",
        {
            "enabled": {"type": "boolean"},
            "replicas": {"type": "integer", "minimum": 1},
            "service": _service("The gateway's Service."),
            "previewDomain": {
                "type": "string",
                "description": "Preview ports by host under this domain; empty: by path only.",
                "pattern": f"^$|{_DNS_SUBDOMAIN}",
            },
            "externalURL": {
                "type": "string",
                "description": "The gateway's address as users outside the cluster reach it;"
                " every URL handed out is on it. Empty: the Service's in-cluster URL.",
                "pattern": "^$|^https?://[^/?#]+(/[^?#]*)?$",
            },
            "serviceProxyGroups": {
                "type": "array",
                "description": "Groups allowed to reach the gateway through the API"
                " server's service proxy (a Role on that Service's proxy alone); empty: none.",
                "items": {"type": "string", "minLength": 1},
            },
            "e2b": _obj(
                "The E2B adapter (docs/e2b.md): a listener for E2B's SDKs on the"
                " Service's port `e2b`, and the RBAC it needs.",
                {
                    "enabled": {"type": "boolean"},
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "domain": {
                        "type": "string",
                        "description": "Hosts `{port}-{id}.<domain>` reach sandboxes' ports;"
                        " empty: none.",
                        "pattern": "^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                    },
                },
            ),
            **_placement("gateway"),
            "settings": _model(GatewaySettings, "Gateway settings (gateway/config.py)."),
        },
    )
    mcp = _obj(
        "sandbox-mcp over streamable HTTP: the sandbox tools for MCP clients (docs/mcp.md).",
        {
            "enabled": {"type": "boolean"},
            "service": _service("The MCP server's Service."),
            "namespace": {
                "type": "string",
                "description": "Where sessions' sandboxes are made by default.",
                "minLength": 1,
                "maxLength": 63,
                "pattern": _DNS_LABEL,
            },
            "runtime": {
                "type": "string",
                "description": "Runtime of a new session's sandbox; empty: the default one.",
            },
            "fromSnapshot": {
                "type": "string",
                "description": "A Snapshot new sessions' sandboxes start from; empty: none.",
            },
            "onEnd": {
                "type": "string",
                "enum": ["pause", "destroy"],
                "description": "What happens to a session's sandbox when the session ends.",
            },
            "sessionIdleSeconds": {
                "type": "integer",
                "minimum": 1,
                "description": "A session without requests this long ends.",
            },
            "gatewayUrl": {
                "type": "string",
                "description": "The gateway's URL for the server's calls and the download"
                " URLs it hands out; empty: the gateway Service's.",
                "pattern": "^$|^https?://",
            },
            "idleTimeout": {
                **_DURATION,
                "description": "spec.lifecycle.idleTimeout of sessions' sandboxes; empty:"
                " the operator's default.",
            },
            **_placement("sandbox-mcp"),
        },
    )
    absolute_path = {"type": "string", "pattern": "^/", "minLength": 2}
    checkpointd = _obj(
        "checkpointd (sandbox-node/): the node component of a pause that keeps memory"
        " (docs/pause-memory.md), on the nodes that run gVisor through sandbox-runsc.",
        {
            "enabled": {"type": "boolean"},
            "namespace": {
                "type": "string",
                "description": "Its namespace, made by the chart with Pod Security `privileged`"
                " (it runs as root with hostPath volumes; the operator's stays `restricted`).",
                "minLength": 1,
                "maxLength": 63,
                "pattern": _DNS_LABEL,
            },
            "image": _obj(
                "checkpointd's image.",
                {
                    "repository": {"type": "string", "minLength": 1},
                    "tag": {"type": "string", "minLength": 1},
                    "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
                },
            ),
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "runsc": {
                **absolute_path,
                "description": "The node's runsc binary: the one sandbox-runsc runs (an image"
                " restores only into the build that took it).",
            },
            "runscRoot": {
                **absolute_path,
                "description": "runsc's state root on the node, as the gVisor shim passes it.",
            },
            "store": {**absolute_path, "description": "The node's checkpoint store."},
            "runscFlags": {
                "type": "array",
                "description": "Global runsc flags (name=value), as the shim's runsc_config.",
                "items": {"type": "string", "pattern": "^[a-z][a-z0-9-]*=.*$"},
            },
            **_placement("checkpointd"),
        },
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "sandbox-operator chart values",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "global": {"type": "object", "description": "Helm's values shared with subcharts."},
            "image": _obj(
                "The operator's image (the gateway and the chart's jobs run it too).",
                {
                    "repository": {"type": "string", "minLength": 1},
                    "tag": {"type": "string", "minLength": 1},
                    "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
                },
            ),
            "watchNamespaces": {
                "type": "array",
                "description": "Namespaces whose objects are reconciled; empty: all.",
                "uniqueItems": True,
                "items": {"type": "string", "maxLength": 63, "pattern": _DNS_LABEL},
            },
            "settings": _model(Settings, "Operator settings (sandbox_operator/config.py)."),
            "replicas": {
                "type": "integer",
                "minimum": 1,
                "description": "Operator replicas; one is active, the others stand by"
                " (Kopf peering; docs/operations.md, High availability).",
            },
            "peering": _obj(
                "The peering object the replicas elect the active one in.",
                {
                    "name": {
                        "type": "string",
                        "maxLength": 253,
                        "pattern": r"^$|" + _DNS_SUBDOMAIN[1:],
                        "description": "Its name; empty: <release>-<namespace>.",
                    }
                },
            ),
            **_placement("operator"),
            "gateway": gateway,
            "mcp": mcp,
            "checkpointd": checkpointd,
            "extraEnv": {
                "type": "array",
                "description": "Extra environment of the operator and gateway containers.",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "value": {"type": "string"},
                        "valueFrom": {"type": "object"},
                    },
                    "additionalProperties": False,
                },
            },
            "catalog": _obj(
                "The runtime catalog: a ClusterSandboxTemplate per runtime in"
                " settings.runtimes, so `kubectl get clustersandboxtemplates` lists them,"
                " and the ClusterSandboxTemplates of `templates` (name -> spec).",
                {
                    "enabled": {"type": "boolean"},
                    "templates": {
                        "type": "object",
                        "description": "More ClusterSandboxTemplates: name -> spec (as the"
                        " CRD takes it), e.g. E2B's `base` and `code-interpreter-v1`.",
                        "additionalProperties": {"type": "object"},
                    },
                },
            ),
            "crds": _obj(
                "The CustomResourceDefinitions.",
                {
                    "upgrade": {
                        "type": "boolean",
                        "description": "Apply the chart's CRDs on `helm upgrade` (a hook"
                        " Job); helm itself installs crds/ once and never updates them.",
                    }
                },
            ),
            "metrics": _obj(
                "Prometheus scraping and the Grafana dashboard.",
                {
                    "serviceMonitor": _obj(
                        "A ServiceMonitor (prometheus-operator) for the operator and gateway.",
                        {
                            "enabled": {"type": "boolean"},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "labels": _string_map("Labels your Prometheus selects monitors by."),
                        },
                    ),
                    "dashboard": _obj(
                        "The Grafana dashboard as a ConfigMap (Grafana's sidecar loads it).",
                        {
                            "enabled": {"type": "boolean"},
                            "labels": _string_map("Labels the sidecar looks for."),
                            "annotations": _string_map("e.g. the sidecar's folder annotation."),
                        },
                    ),
                },
            ),
        },
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"
