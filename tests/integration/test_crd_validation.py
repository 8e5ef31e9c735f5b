"""Bad manifests are refused by the real API server, with a message a person can act on.

No operator is involved: this is the CRDs' OpenAPI schemas and CEL rules alone.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from devcluster.controlplane import ControlPlane
from sandbox_operator.api.common import GROUP, VERSION
from tests.integration.conftest import kubectl, namespace_manifest
from tests.kube import ApiError, KubeJSON, api_path, core_path

LONG = "x" * 300

# (kind, plural, spec, metadata overrides, fragment the server's message must contain)
BAD: list[tuple[str, str, dict[str, Any], dict[str, Any], str]] = [
    (
        "Sandbox",
        "sandboxes",
        {"lifecycle": {"idleTimeout": "30x"}},
        {},
        "spec.lifecycle.idleTimeout",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"lifecycle": {"maxLifetime": "1 day"}},
        {},
        "spec.lifecycle.maxLifetime",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"resources": {"memory": "-1Gi"}},
        {},
        "memory must be a quantity from 32Mi to 4Ti",
    ),
    ("Sandbox", "sandboxes", {"resources": {"cpu": 0}}, {}, "cpu must be a quantity from 10m"),
    (
        "Sandbox",
        "sandboxes",
        {"workspace": {"size": "lots"}},
        {},
        "size must be a quantity from 16Mi",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"files": [{"path": "../outside", "content": "x"}]},
        {},
        "must be a path relative to the workspace",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"files": [{"path": f"f{i}", "content": "x" * 70_000} for i in range(2)]},
        {},
        "the contents of files (files) may hold at most 131072 characters",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"files": [{"path": "a", "content": "x"}, {"path": "a", "content": "y"}]},
        {},
        "Duplicate value",
    ),
    # Accepted once, never able to run: one byte of memory, a thousand cores.
    ("Sandbox", "sandboxes", {"resources": {"memory": 1}}, {}, "memory must be a quantity from"),
    ("Sandbox", "sandboxes", {"resources": {"cpu": "1e3"}}, {}, "cpu must be a quantity from"),
    (
        "Sandbox",
        "sandboxes",
        {"lifecycle": {"idleTimeout": "0s"}},
        {},
        "idleTimeout must be at least 1s",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"env": [{"name": f"V{i}", "value": "x" * 30000} for i in range(3)]},
        {},
        "the values of env (env) may hold at most 65536 characters together",
    ),
    ("Sandbox", "sandboxes", {"lifecycle": {"onIdle": "Sleep"}}, {}, 'Unsupported value: "Sleep"'),
    (
        "Sandbox",
        "sandboxes",
        {"lifecycle": {"expiresAt": "tomorrow"}},
        {},
        "spec.lifecycle.expiresAt",
    ),
    ("Sandbox", "sandboxes", {"workspace": {"mountPath": "/home/../etc"}}, {}, "should match"),
    (
        "Sandbox",
        "sandboxes",
        {"workspace": {"mountPath": "/etc/app"}},
        {},
        "mountPath cannot hide a directory of the image or the pod",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"network": {"egress": "Everything"}},
        {},
        'Unsupported value: "Everything"',
    ),
    (
        "Sandbox",
        "sandboxes",
        {"runtime": "python", "image": "python:3.12"},
        {},
        "set at most one of runtime or image",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"workspace": {"ephemeral": True, "storageClassName": "fast"}},
        {},
        "storageClassName cannot be set for an ephemeral workspace",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"workspace": {"ephemeral": True}, "lifecycle": {"onIdle": "Pause"}},
        {},
        "Pause needs a persistent workspace",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"lifecycle": {"pauseMode": "Memory"}},
        {},
        "pauseMode: Memory needs runtimeClassName: a gVisor class",
    ),
    (
        "Sandbox",
        "sandboxes",
        {
            "runtimeClassName": "gvisor",
            "workspace": {"ephemeral": True},
            "lifecycle": {"pauseMode": "Memory"},
        },
        {},
        "pauseMode: Memory needs a persistent workspace",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"lifecycle": {"pauseMode": "Processes"}},
        {},
        "spec.lifecycle.pauseMode",
    ),
    (
        "Sandbox",
        "sandboxes",
        {"network": {"exposedPorts": [{"name": "web", "port": 70000}]}},
        {},
        "spec.network.exposedPorts[0].port",
    ),
    ("Sandbox", "sandboxes", {"env": [{"name": "A"}]}, {}, "exactly one of value or valueFrom"),
    (
        "Sandbox",
        "sandboxes",
        {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
        {},
        "Duplicate value",
    ),
    ("Sandbox", "sandboxes", {"image": LONG * 2}, {}, "spec.image: Too long"),
    ("Sandbox", "sandboxes", {"runtime": "Python 3"}, {}, "spec.runtime"),
    ("Sandbox", "sandboxes", {}, {"name": "9lives"}, "a Sandbox name must start with a letter"),
    ("Sandbox", "sandboxes", {}, {"name": "a" * 51}, "at most 50 characters"),
    (
        "Execution",
        "executions",
        {"command": ["true"]},
        {},
        "exactly one of sandboxRef or sandboxTemplate",
    ),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}, "sandboxTemplate": {}, "command": ["true"]},
        {},
        "exactly one of sandboxRef or sandboxTemplate",
    ),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}},
        {},
        "exactly one of command or script",
    ),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}, "command": ["true"], "script": "true"},
        {},
        "exactly one of command or script",
    ),
    ("Execution", "executions", {"sandboxRef": {"name": "a"}, "command": []}, {}, "spec.command"),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}, "command": ["true"], "timeout": "-5s"},
        {},
        "spec.timeout",
    ),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}, "command": ["true"], "timeout": "2h"},
        {},
        "timeout must be from 1s to 1h",
    ),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}, "script": "x" * 100000, "stdin": "y" * 40000},
        {},
        "may hold at most 131072 characters together",
    ),
    (
        "Execution",
        "executions",
        {
            "sandboxTemplate": {"paused": True},
            "command": ["true"],
        },
        {},
        "sandboxTemplate.paused cannot be true",
    ),
    # 2.5 MB: a schema message, not the storage layer's own error.
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}, "command": ["true"], "stdin": "z" * 2_500_000},
        {},
        "spec.stdin: Too long",
    ),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}, "command": ["true"], "ttlSecondsAfterFinished": -1},
        {},
        "spec.ttlSecondsAfterFinished",
    ),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "a"}, "command": ["true"], "workingDir": "../etc"},
        {},
        "must be a path relative to the workspace",
    ),
    (
        "Execution",
        "executions",
        {
            "sandboxRef": {"name": "a"},
            "command": ["true"],
            "files": [{"path": "/etc/passwd", "content": "x"}],
        },
        {},
        "must be a path relative to the workspace",
    ),
    (
        "Execution",
        "executions",
        {"sandboxRef": {"name": "Not_A_Name"}, "command": ["true"]},
        {},
        "spec.sandboxRef.name",
    ),
    ("Snapshot", "snapshots", {}, {}, "spec.sandboxRef: Required value"),
    (
        "Snapshot",
        "snapshots",
        {"sandboxRef": {"name": "a"}, "retainPolicy": "Forever"},
        {},
        'Unsupported value: "Forever"',
    ),
    ("Snapshot", "snapshots", {"sandboxRef": {"name": "a"}, "tag": "has spaces"}, {}, "spec.tag"),
]


@pytest.fixture(scope="module")
def namespace(kube: KubeJSON, crds: None) -> Iterator[str]:
    name = f"v-{uuid.uuid4().hex[:8]}"
    kube.create(core_path("namespaces"), namespace_manifest(name))
    yield name
    kube.delete(core_path("namespaces", name=name))


def _path(ns: str, plural: str, name: str | None = None) -> str:
    return api_path(f"{GROUP}/{VERSION}", plural, ns, name)


def _create(
    kube: KubeJSON,
    ns: str,
    kind: str,
    plural: str,
    spec: dict[str, Any],
    meta: dict[str, Any],
) -> None:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": kind,
        "metadata": {"name": f"bad-{uuid.uuid4().hex[:6]}", **meta},
        "spec": spec,
    }
    kube.create(_path(ns, plural), body)


@pytest.mark.parametrize(
    ("kind", "plural", "spec", "meta", "expected"),
    BAD,
    ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)],
)
def test_bad_spec_is_refused_with_a_readable_message(
    kube: KubeJSON,
    namespace: str,
    kind: str,
    plural: str,
    spec: dict[str, Any],
    meta: dict[str, Any],
    expected: str,
) -> None:
    with pytest.raises(ApiError) as refused:
        _create(kube, namespace, kind, plural, spec, meta)
    assert refused.value.status == 422
    message = refused.value.body["message"]
    assert expected in message, message


def test_good_specs_are_accepted_with_defaults(kube: KubeJSON, namespace: str) -> None:
    _create(
        kube,
        namespace,
        "Sandbox",
        "sandboxes",
        {"runtime": "python", "resources": {"cpu": 2, "memory": "1Gi"}},
        {"name": "ok"},
    )
    body = kube.read(_path(namespace, "sandboxes", "ok"))
    # Objects get their server-side defaults; the fields a template may set get none
    # (the operator's defaults apply when neither the Sandbox nor a template sets them).
    assert body["spec"]["lifecycle"] == {}
    assert body["spec"]["network"] == {}
    assert body["spec"]["workspace"] == {}
    assert body["spec"]["paused"] is False
    assert body["spec"]["resources"]["cpu"] == 2  # int-or-string, kept as written
    _create(
        kube,
        namespace,
        "Execution",
        "executions",
        {"sandboxRef": {"name": "ok"}, "script": "echo hi"},
        {"name": "run"},
    )
    execution = kube.read(_path(namespace, "executions", "run"))
    assert execution["spec"]["timeout"] == "3m"


def test_execution_command_is_immutable(kube: KubeJSON, namespace: str) -> None:
    _create(
        kube,
        namespace,
        "Execution",
        "executions",
        {"sandboxRef": {"name": "ok"}, "command": ["echo", "1"]},
        {"name": "fixed"},
    )
    fixed = _path(namespace, "executions", "fixed")
    with pytest.raises(ApiError) as refused:
        kube.patch(fixed, {"spec": {"command": ["rm", "-rf", "/"]}})
    assert "immutable after creation" in refused.value.body["message"]
    # Cancelling is the one change allowed.
    kube.patch(fixed, {"spec": {"cancel": True}})


def _one_shot(template_files: int, template_env: int, script: int) -> dict[str, Any]:
    """A one-shot Execution with inputs of these sizes (env in values of 32 KiB at most)."""
    env = [
        {"name": f"V{i}", "value": "e" * min(32_768, template_env - i * 32_768)}
        for i in range(-(-template_env // 32_768))
    ]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Execution",
        "metadata": {"name": f"big-{uuid.uuid4().hex[:6]}"},
        "spec": {
            "sandboxTemplate": {
                "files": [{"path": "in.txt", "content": "f" * template_files}],
                "env": env,
            },
            "script": "s" * script,
        },
    }


def test_every_admitted_one_shot_can_be_kubectl_applied(
    control_plane: ControlPlane, kube: KubeJSON, namespace: str
) -> None:
    """A one-shot's sandbox files and env count toward its inputs: one over the
    bound is refused with the schema's message (it was admitted, and then could
    not be `kubectl apply`-ed), and the largest admitted one can be applied."""
    over = _one_shot(131_072, 65_536, 131_072)
    with pytest.raises(ApiError) as refused:
        kube.create(_path(namespace, "executions"), over)
    message = refused.value.body["message"]
    assert "with a one-shot's sandboxTemplate (" in message, message
    assert "may hold at most 196608 characters together" in message, message
    # As large as a Sandbox's files and env may be together, with an Execution's inputs.
    largest = _one_shot(90_000, 65_536, 41_072)
    applied = kubectl(control_plane, "apply", "-n", namespace, "-f", "-", input=json.dumps(largest))
    assert applied.returncode == 0, applied.stderr


def test_reapplying_an_unchanged_manifest_changes_nothing(
    control_plane: ControlPlane, namespace: str
) -> None:
    """No defaults inside list items: the API server fills none in, so the second
    `kubectl apply` of the same manifest finds nothing to change."""
    docs = [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Sandbox",
            "metadata": {"name": "ported"},
            "spec": {"network": {"exposedPorts": [{"name": "web", "port": 3000}]}},
        },
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "SandboxTemplate",
            "metadata": {"name": "with-setup"},
            "spec": {
                "setup": [{"name": "deps", "script": "true"}],
                "sandbox": {"network": {"exposedPorts": [{"name": "web", "port": 3000}]}},
            },
        },
    ]
    manifest = "\n---\n".join(json.dumps(d) for d in docs)
    first = kubectl(control_plane, "apply", "-n", namespace, "-f", "-", input=manifest)
    assert first.returncode == 0, first.stderr
    again = kubectl(control_plane, "apply", "-n", namespace, "-f", "-", input=manifest)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split("\n")[:2] == [
        "sandbox.sandbox.dev/ported unchanged",
        "sandboxtemplate.sandbox.dev/with-setup unchanged",
    ], again.stdout
