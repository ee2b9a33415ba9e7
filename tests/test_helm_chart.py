"""The Helm chart, rendered by Helm itself (helm-python-sdk embeds Helm's Go library): every manifest
valid against the Kubernetes schemas, the rendered config.toml accepted by `llmgw check-config`, the
backend options wired in, and bad values refused by values.schema.json."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python import Chart, HelmError

from tests.server import ROOT

CHART = ROOT / "helm" / "llm-gateway"
K8S_VERSION = "1.30.0"
CRDS = {"ServiceMonitor"}  # the Prometheus operator's: not in the Kubernetes schemas

VLLM = {"backends": {"vllm": {"enabled": True}}}
TGI = {"backends": {"tgi": {"enabled": True}}}
TRITON = {"backends": {"triton": {"enabled": True}}}
MIGRATION = {  # TGI → vLLM: a 90/10 split, TGI as fallback, 10% shadowed to Triton
    "backends": {"vllm": {"enabled": True}, "tgi": {"enabled": True}, "triton": {"enabled": True}},
    "config": {"engine": {"enabled": False}, "defaultModel": "llama",
               "models": {"llama": {"routes": [{"backend": "tgi", "weight": 90}, {"backend": "vllm", "weight": 10}],
                                    "fallback": ["tgi"], "shadow": {"backend": "triton", "sample": 0.1},
                                    "aliases": ["meta-llama/Llama-3.1-8B-Instruct"]}}},
    "auth": {"keys": [{"name": "team-a", "value": "a-very-secret-key", "models": ["llama"],
                       "requests_per_minute": 600}], "adminKey": "admin-secret-key", "protectMetrics": True},
    "ingress": {"enabled": True}, "serviceMonitor": {"enabled": True}, "reloadStrategy": "restart",
}
OPTIONS = {"default": {}, "vllm": VLLM, "tgi": TGI, "triton": TRITON, "migration": MIGRATION}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = Chart.load(CHART)
    manifests = chart.render(values, name="gw", namespace="llm", is_install=True)
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def config_toml(docs: list[dict[str, Any]]) -> str:
    (config,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    return config["data"]["config.toml"]


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_manifest_is_valid_kubernetes(option: str) -> None:
    docs = render(OPTIONS[option])
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "NetworkPolicy"} <= {d["kind"] for d in docs}
    for doc in docs:
        if doc["kind"] in CRDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]["endpoints"]
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_rendered_config_passes_llmgw_check_config(option: str, tmp_path: Path) -> None:
    docs = render(OPTIONS[option])
    path = tmp_path / "config.toml"
    path.write_text(config_toml(docs))
    # the Deployment's environment, as Kubernetes would fill it from the Secret
    env = {**os.environ}
    (gateway,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "gw-llm-gateway"]
    for var in gateway["spec"]["template"]["spec"]["containers"][0].get("env", []):
        env[var["name"]] = "k" * 16
    done = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr + path.read_text()


def test_gateway_pod_is_locked_down_and_drains_before_it_is_killed() -> None:
    docs = render({})
    (deployment,) = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert "drain_timeout = 25" in config_toml(docs)
    assert pod["terminationGracePeriodSeconds"] == 5 + 25 + 10
    assert "watch_config = true" in config_toml(docs)  # ConfigMap updates reach the hot reload
    assert not any("checksum/config" in k for k in deployment["spec"]["template"]["metadata"]["annotations"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "subPath" not in mounts["/etc/llm-gateway"]  # a subPath mount would never see updates


def test_backend_options_are_wired_into_the_gateway_config() -> None:
    docs = render(MIGRATION)
    config = config_toml(docs)
    services = {d["metadata"]["name"]: d["spec"]["ports"][0]["port"] for d in by_kind(docs, "Service")}
    for name, port in (("vllm", 8000), ("tgi", 8080), ("triton", 8000)):
        assert services[f"gw-llm-gateway-{name}"] == port
        assert f'base_url = "http://gw-llm-gateway-{name}:{port}"' in config
    assert 'routes = [{backend = "tgi", weight = 90}, {backend = "vllm", weight = 10}]' in config
    assert 'shadow = {backend = "triton", sample = 0.1}' in config
    assert "a-very-secret-key" not in config and 'key_env = "LLMGW_KEY_TEAM_A"' in config
    (secret,) = by_kind(docs, "Secret")
    assert secret["stringData"] == {"LLMGW_KEY_TEAM_A": "a-very-secret-key", "LLMGW_ADMIN_KEY": "admin-secret-key"}
    deployments = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
    vllm = deployments["gw-llm-gateway-vllm"]["spec"]["template"]["spec"]
    assert vllm["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert vllm["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert vllm["containers"][0]["args"][:4] == ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--served-model-name",
                                                 "llama-3.1-8b"]
    triton = deployments["gw-llm-gateway-triton"]["spec"]["template"]["spec"]["containers"][0]
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    policies = {d["metadata"]["name"]: d for d in by_kind(docs, "NetworkPolicy")}
    only_gateway = policies["gw-llm-gateway-vllm"]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert only_gateway == {"app.kubernetes.io/name": "llm-gateway", "app.kubernetes.io/instance": "gw"}
    annotations = deployments["gw-llm-gateway"]["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/config"])  # reloadStrategy: restart


def test_a_whole_config_given_in_values_is_used_as_is() -> None:
    text = (ROOT / "config.toml").read_text()
    assert config_toml(render({"configToml": text})).strip() == text.strip()


@pytest.mark.parametrize("values", [
    {"port": "eighty"}, {"reloadStrategy": "sometimes"}, {"replicas": 3},
    {"backends": {"vllm": {"enabled": True, "gpus": -1}}}, {"image": {"variant": "rocm"}},
    {"auth": {"keys": [{"name": "bad name!", "value": "0123456789"}]}},
    {"config": {"engine": {"enabled": True, "dtype": "int4"}}},
    {"backends": {"triton": {"enabled": True, "dialect": "grpc"}}},
], ids=lambda v: json.dumps(v)[:40])
def test_bad_values_are_refused_at_install_time(values: dict[str, Any]) -> None:
    with pytest.raises(HelmError, match="(?i)schema|values"):
        render(values)


def test_dashboard_queries_only_metrics_the_gateway_exports() -> None:
    docs = render({})
    (dashboard,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    panels = json.loads(dashboard["data"]["llm-gateway.json"])["panels"]
    exported = set(re.findall(r'"(llmgw_[a-z0-9_]+)"', (ROOT / "gateway/telemetry/metrics.py").read_text()
                              + (ROOT / "gateway/state.py").read_text()))
    for panel in panels:
        for target in panel["targets"]:
            for name in re.findall(r"llmgw_[a-z0-9_]+", target["expr"]):
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                assert base in exported, f"{panel['title']}: {name}"


def test_backend_replicas_sit_behind_headless_services_wired_as_dns_pools() -> None:
    values = {"backends": {"vllm": {"enabled": True, "replicas": 3, "balance": "least_load"},
                           "tgi": {"enabled": True, "replicas": 2}, "triton": {"enabled": True, "replicas": 2}}}
    docs = render(values)
    deployments = {d["metadata"]["name"]: d["spec"].get("replicas") for d in by_kind(docs, "Deployment")}
    assert {k: deployments[f"gw-llm-gateway-{k}"] for k in ("vllm", "tgi", "triton")} == \
        {"vllm": 3, "tgi": 2, "triton": 2}
    services = {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "Service")}
    for name in ("vllm", "tgi", "triton"):
        assert services[f"gw-llm-gateway-{name}"]["clusterIP"] == "None"  # DNS answers each ready pod
    from gateway.config import parse_config

    config = parse_config(config_toml(docs))
    for name, balance in (("vllm", "least_load"), ("tgi", "prefix"), ("triton", "prefix")):
        settings = config.backends[name].settings
        assert (settings.discovery, settings.balance, settings.dns_interval) == ("dns", balance, 10.0)
        assert settings.base_url.startswith(f"http://gw-llm-gateway-{name}:")
    assert config.backends["triton"].settings.metrics_port == 8002
    policies = {d["metadata"]["name"]: d for d in by_kind(docs, "NetworkPolicy")}
    ports = [p["port"] for p in policies["gw-llm-gateway-triton"]["spec"]["ingress"][0]["ports"]]
    assert ports == [8000, 8002]  # the gateway scrapes Triton's metrics port too
