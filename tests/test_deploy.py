"""The Kubernetes manifests under deploy/: schema validation (deploy/validate.py) and cross-file facts.

Needs kubernetes-validate, jsonschema and PyYAML (the test extra). No cluster, no network, no server:
it only reads the files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import kubernetes_validate  # noqa: F401  (the test extra installs it: CI validates deploy/)
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
# The worker's liveness route: 200 while the process serves HTTP, draining included (GET /health is
# 503 while draining, so it can only be the readiness probe). The name sglang-router uses.
LIVENESS_PATH = "/liveness"
READINESS_PATH = "/health"


def _load_validator() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_validate", DEPLOY / "validate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


validator = _load_validator()


def _docs() -> list[dict]:
    out = []
    for f in sorted(DEPLOY.rglob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text(encoding="utf-8")) if d is not None]
    return out


DOCS = _docs()


def _of_kind(kind: str) -> list[dict]:
    return [d for d in DOCS if d["kind"] == kind]


def _one(kind: str, name: str) -> dict:
    found = [d for d in _of_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _flag_values(args: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next --flag ([] if the flag is absent)."""
    if flag not in args:
        return []
    values = []
    for a in args[args.index(flag) + 1:]:
        if a.startswith("--"):
            break
        values.append(a)
    return values


def _flag(args: list[str], flag: str) -> str:
    values = _flag_values(args, flag)
    assert len(values) == 1, f"{flag}: expected one value, got {values}"
    return values[0]


def _pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _prestop_sleep(container: dict) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


WORKERS = [
    d for d in _of_kind("Deployment") if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
]
ROUTER = _one("Deployment", "sglang-router")
ROUTER_ARGS = _container(ROUTER)["args"]


def _variant(name: str) -> dict:
    found = [d for d in WORKERS if _pod_labels(d).get("app.kubernetes.io/variant") == name]
    assert len(found) == 1
    return found[0]


def _container_port(deployment: dict, name: str = "http") -> int:
    ports = {p["name"]: p["containerPort"] for p in _container(deployment)["ports"]}
    return ports[name]


# ---- schema validation ---------------------------------------------------------------------------


def test_validator_accepts_deploy_dir(capsys):
    assert validator.main([str(DEPLOY)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(DOCS) + 1  # one line per document, then the summary
    assert all(line.startswith("OK ") for line in lines[:-1]), lines
    assert any("ScaledObject" in line and "keda-scaledobject.schema.json" in line for line in lines)


def test_validator_rejects_bad_documents(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text(
        """
apiVersion: apps/v1
kind: Deployment
metadata: {name: typo}
spec:
  replica: 2
  selector: {matchLabels: {a: b}}
  template: {metadata: {labels: {a: b}}, spec: {containers: [{name: c, image: i}]}}
---
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata: {name: no-triggers}
spec: {scaleTargetRef: {name: x}}
---
apiVersion: example.com/v1
kind: Unknown
metadata: {name: crd-without-schema}
""",
        encoding="utf-8",
    )
    assert validator.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL ") == 3, out
    assert "'replica' was unexpected" in out
    assert "'triggers' is a required property" in out
    assert "no schema for example.com/v1 Unknown" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert validator.main([str(empty)]) == 2


# ---- cross-file facts ----------------------------------------------------------------------------


def test_router_discovers_exactly_the_worker_pods():
    assert "--service-discovery" in ROUTER_ARGS
    selector = dict(kv.split("=", 1) for kv in _flag_values(ROUTER_ARGS, "--selector"))
    assert selector, "the router needs a --selector"
    assert len(WORKERS) == 2  # the CPU and the GPU variant
    for worker in WORKERS:
        assert _matches(selector, _pod_labels(worker)), worker["metadata"]["name"]
        assert int(_flag(ROUTER_ARGS, "--service-discovery-port")) == _container_port(worker)
    assert not _matches(selector, _pod_labels(ROUTER)), "the router must not discover itself"


def test_router_rbac_is_a_namespaced_pod_reader():
    namespace = ROUTER["metadata"]["namespace"]
    # Without --service-discovery-namespace the router watches all namespaces (a ClusterRole).
    assert _flag(ROUTER_ARGS, "--service-discovery-namespace") in (namespace, "$(POD_NAMESPACE)")
    account = ROUTER["spec"]["template"]["spec"]["serviceAccountName"]
    _one("ServiceAccount", account)
    [binding] = _of_kind("RoleBinding")
    assert binding["roleRef"]["kind"] == "Role"
    assert {"kind": "ServiceAccount", "name": account, "namespace": namespace} in binding["subjects"]
    role = _one("Role", binding["roleRef"]["name"])
    assert role["metadata"]["namespace"] == namespace
    [rule] = role["rules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert {"list", "watch"} <= set(rule["verbs"]) <= {"get", "list", "watch"}
    assert not _of_kind("ClusterRole") and not _of_kind("ClusterRoleBinding")


def test_router_circuit_breaker_cannot_be_opened_by_client_errors():
    # sglang-router 0.3.2 counts a worker's 400 as a failure (circuit opened after 10 by default).
    disabled = "--disable-circuit-breaker" in ROUTER_ARGS
    threshold = int((_flag_values(ROUTER_ARGS, "--cb-failure-threshold") or ["10"])[0])
    assert disabled or threshold >= 100


def test_probe_routes_are_open_without_the_api_key():
    from server.app import OPEN_PATHS

    assert {LIVENESS_PATH, READINESS_PATH} <= set(OPEN_PATHS)


@pytest.mark.parametrize("worker", WORKERS, ids=lambda d: d["metadata"]["name"])
def test_worker_probes(worker):
    c = _container(worker)
    assert c["startupProbe"]["httpGet"]["path"] == READINESS_PATH
    assert c["readinessProbe"]["httpGet"]["path"] == READINESS_PATH
    assert c["livenessProbe"]["httpGet"]["path"] == LIVENESS_PATH
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "http"


@pytest.mark.parametrize("worker", WORKERS, ids=lambda d: d["metadata"]["name"])
def test_worker_args_and_scrape_annotations(worker):
    args = _container(worker)["args"]
    port = _container_port(worker)
    assert _flag(args, "--host") == "0.0.0.0"
    assert int(_flag(args, "--port")) == port == 30000
    assert "--enable-metrics" in args
    assert _flag(args, "--served-model-name")
    annotations = worker["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("worker", WORKERS, ids=lambda d: d["metadata"]["name"])
def test_worker_args_are_flags_the_server_accepts(worker):
    server_args = pytest.importorskip("server.args")
    c = _container(worker)
    assert c["command"] == ["python", "-m", "server"]
    parsed = server_args.parse_args(c["args"])  # argparse exits on an unknown flag or a bad value
    assert parsed.port == _container_port(worker) and parsed.enable_metrics
    assert parsed.shutdown_grace_period == float(_flag(c["args"], "--shutdown-grace-period"))


@pytest.mark.parametrize("deployment", [*WORKERS, ROUTER], ids=lambda d: d["metadata"]["name"])
def test_termination_grace_covers_prestop_and_drain(deployment):
    c = _container(deployment)
    flag = "--shutdown-grace-period-secs" if deployment is ROUTER else "--shutdown-grace-period"
    drain = float(_flag(c["args"], flag))
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert _prestop_sleep(c) >= 1  # let endpoints and the router drop the pod before SIGTERM
    assert grace > _prestop_sleep(c) + drain


def test_gpu_and_cpu_variants():
    gpu, cpu = _container(_variant("gpu")), _container(_variant("cpu"))
    assert int(gpu["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert _flag(gpu["args"], "--device") == "cuda"
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert "nvidia.com/gpu" not in cpu["resources"].get("requests", {})
    assert _flag(cpu["args"], "--device") == "cpu"
    assert gpu["image"] == cpu["image"]  # both from ./Dockerfile


def test_worker_deployments_do_not_share_pods():
    a, b = (d["spec"]["selector"]["matchLabels"] for d in WORKERS)
    for worker in WORKERS:
        assert _matches(worker["spec"]["selector"]["matchLabels"], _pod_labels(worker))
    assert a != b and not (_matches(a, _pod_labels(WORKERS[1])) or _matches(b, _pod_labels(WORKERS[0])))


def test_services_select_their_pods():
    worker_svc = _one("Service", "minimax-worker")
    assert all(_matches(worker_svc["spec"]["selector"], _pod_labels(w)) for w in WORKERS)
    router_svc = _one("Service", "sglang-router")
    assert _matches(router_svc["spec"]["selector"], _pod_labels(ROUTER))
    assert not _matches(router_svc["spec"]["selector"], _pod_labels(WORKERS[0]))
    router_ports = {p["name"] for p in _container(ROUTER)["ports"]}
    assert {p["targetPort"] for p in router_svc["spec"]["ports"]} <= router_ports
    assert int(_flag(ROUTER_ARGS, "--prometheus-port")) == _container_port(ROUTER, "metrics")


def test_scaledobject_scales_a_worker_on_its_queue():
    [so] = _of_kind("ScaledObject")
    target = so["spec"]["scaleTargetRef"]
    worker = _one("Deployment", target["name"])
    assert worker in WORKERS and target.get("kind", "Deployment") == "Deployment"
    assert so["metadata"]["namespace"] == worker["metadata"]["namespace"]
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    [trigger] = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    served = _flag(_container(worker)["args"], "--served-model-name")
    assert "sglang:num_queue_reqs" in query and f'model_name="{served}"' in query
    assert float(trigger["metadata"]["threshold"]) > 0
