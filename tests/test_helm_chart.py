"""The Helm chart, rendered by Helm itself (helm-python-sdk embeds Helm's Go library): every manifest
valid against the Kubernetes schemas, the rendered config.toml accepted by `llmgw check-config`, the
backend options wired in, and bad values refused by values.schema.json."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from helm_python import HelmError

from tests.helm_chart import STATE, STATE_ENV, by_kind, config_toml, pods, render
from tests.server import ROOT

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
# prefill/decode disaggregation: vLLM as a prefill and a decode Deployment; the engine's workers in the gateway pod
VLLM_PD = {"backends": {"vllm": {"enabled": True, "disaggregation": {
    "enabled": True, "thresholdTokens": 256,
    "prefill": {"replicas": 2, "kvRole": "kv_producer", "extraArgs": ["--max-num-batched-tokens", "16384"]},
    "decode": {"replicas": 3, "kvRole": "kv_consumer", "gpus": 2, "extraArgs": ["--tensor-parallel-size", "2"]},
    "kvTransferConfig": {"kv_connector": "NixlConnector", "kv_buffer_device": "cuda"}}}},
    "config": {"engine": {"enabled": False}, "models": {"llama": {"backend": "vllm"}}}}
ENGINE_PD = {"config": {"engine": {"enabled": True, "replicas": 3, "prefill_replicas": 1, "pd_threshold_tokens": 512}}}
OPTIONS = {"default": {}, "vllm": VLLM, "tgi": TGI, "triton": TRITON, "migration": MIGRATION, "vllm-pd": VLLM_PD,
           "engine-pd": ENGINE_PD, "state": STATE}


def gateway_reads_pd_keys(option: str) -> bool:
    """Whether this checkout's backends accept the P/D keys the chart renders for `option` (issue 33)."""
    from backends.engine import EngineSettings
    from backends.openai import OpenAISettings

    needs = {"vllm-pd": (OpenAISettings, "prefill_endpoints"), "engine-pd": (EngineSettings, "prefill_replicas")}
    if option not in needs:
        return True
    settings, key = needs[option]
    return key in settings.__struct_fields__


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
    if not gateway_reads_pd_keys(option):
        pytest.skip("the gateway's backends do not read the P/D keys yet")
    docs = render(OPTIONS[option])
    path = tmp_path / "config.toml"
    path.write_text(config_toml(docs))
    # the Deployment's environment, as Kubernetes would fill it from the Secret
    env = {**os.environ}
    (gateway,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "gw-llm-gateway"]
    for var in gateway["spec"]["template"]["spec"]["containers"][0].get("env", []):
        env[var["name"]] = STATE_ENV.get(var["name"], "k" * 16)
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
    {"backends": {"vllm": {"disaggregation": {"enabled": True, "prefil": {"replicas": 1}}}}},
    {"backends": {"vllm": {"disaggregation": {"decode": {"replicas": 1, "kvRole": "kv_producer"}}}}},
    {"backends": {"vllm": {"disaggregation": {"prefill": {"replicas": -1, "kvRole": "kv_producer"}}}}},
    {"backends": {"vllm": {"disaggregation": {"kvTransferConfig": {"kv_connector": "NixlConnector",
                                                                   "kv_role": "kv_both"}}}}},
    {"backends": {"vllm": {"disaggregation": {"kvTransferConfig": {"kv_connector": "NixlConnector",
                                                                   "engine_id": "same-for-all"}}}}},
    {"backends": {"vllm": {"disaggregation": {"kvTransferConfig": {"kv_connector": ""}}}}},
    {"backends": {"vllm": {"disaggregation": {"thresholdTokens": -1}}}},
    {"config": {"engine": {"enabled": True, "prefill_replicas": -1}}},
    {"config": {"engine": {"enabled": True, "shmSize": "lots"}}},
    {"state": {"enabled": True, "database": "sqlite:///tmp/state.db"}},  # per pod: not shared by the replicas
    {"state": {"enabled": True, "database": "postgresql://u@h/db", "redis": "http://h:6379"}},
    {"state": {"enabled": True, "database": "postgresql://u@h/db", "settings": {"record_usag": True}}},
    {"state": {"enabled": True, "database": "postgresql://u@h/db", "settings": {"auto_migrate": True}}},
    {"state": {"enabled": True, "database": "postgresql://u@h/db", "settings": {"usage_batch_rows": 0}}},
    {"state": {"enabled": True, "existingSecret": "Not_A_Name"}},
    {"state": {"enabled": "yes", "database": "postgresql://u@h/db"}},
], ids=lambda v: json.dumps(v)[:40])
def test_bad_values_are_refused_at_install_time(values: dict[str, Any]) -> None:
    with pytest.raises(HelmError, match="(?i)schema|values"):
        render(values)


def test_dashboard_queries_only_metrics_the_gateway_exports() -> None:
    docs = render({})
    (dashboard,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    panels = json.loads(dashboard["data"]["llm-gateway.json"])["panels"]
    sources = [*(ROOT / "gateway" / "telemetry").glob("*.py"), ROOT / "gateway" / "state.py"]
    exported = set(re.findall(r'"(llmgw_[a-z0-9_]+)"', "".join(path.read_text() for path in sources)))
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


def policy_rules(docs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in by_kind(docs, "NetworkPolicy")}[name]["spec"]["ingress"]


def test_vllm_disaggregation_renders_a_prefill_and_a_decode_deployment_wired_into_the_gateway() -> None:
    docs = render(VLLM_PD)
    deployments = pods(docs)
    assert "gw-llm-gateway-vllm" not in deployments  # instead of the one vLLM Deployment
    services = {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "Service")}
    assert "gw-llm-gateway-vllm" not in services
    expected = {"prefill": ("kv_producer", 2, "1", ["--max-num-batched-tokens", "16384"]),
                "decode": ("kv_consumer", 3, "2", ["--tensor-parallel-size", "2"])}
    for role, (kv_role, replicas, gpus, extra) in expected.items():
        deployment = deployments[f"gw-llm-gateway-vllm-{role}"]
        labels = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "gw", "llm-d.ai/role": role}
        assert deployment["spec"]["selector"]["matchLabels"] == labels
        assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        assert deployment["metadata"]["labels"]["llm-d.ai/role"] == role
        assert deployment["spec"]["replicas"] == replicas
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert args[:4] == ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama-3.1-8b"]
        assert args.count("--kv-transfer-config") == 1
        i = args.index("--kv-transfer-config")
        assert args[i - len(extra):i] == extra  # the role's own arguments, after the backend's
        assert json.loads(args[i + 1]) == {"kv_connector": "NixlConnector", "kv_role": kv_role,
                                           "kv_buffer_device": "cuda"}
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert {"name": "nixl", "containerPort": 5600, "protocol": "TCP"} in container["ports"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        # one headless Service per role: DNS answers each ready pod of that role only
        service = services[f"gw-llm-gateway-vllm-{role}"]
        assert service["clusterIP"] == "None" and service["selector"] == labels
        assert service["ports"][0]["port"] == 8000
    table = tomllib.loads(config_toml(docs))["backends"]["vllm"]
    assert table["prefill_endpoints"] == ["http://gw-llm-gateway-vllm-prefill:8000"]
    assert table["decode_endpoints"] == ["http://gw-llm-gateway-vllm-decode:8000"]
    assert (table["type"], table["discovery"], table["pd_threshold_tokens"]) == ("openai", "dns", 256)
    assert "base_url" not in table and "endpoints" not in table
    # decode pods pull KV from prefill pods: the vLLM policy admits its own pods on every port, and the gateway
    rules = policy_rules(docs, "gw-llm-gateway-vllm")
    assert rules[0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert rules[1] == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "vllm",
                                                                  "app.kubernetes.io/instance": "gw"}}}]}


def test_vllm_disaggregation_off_renders_the_chart_as_before() -> None:
    plain = render(VLLM)
    tuned_but_off = render({"backends": {"vllm": {"enabled": True, "disaggregation": {
        **VLLM_PD["backends"]["vllm"]["disaggregation"], "enabled": False}}}})
    assert tuned_but_off == plain
    (vllm,) = [d for d in by_kind(plain, "Deployment") if d["metadata"]["name"] == "gw-llm-gateway-vllm"]
    (container,) = vllm["spec"]["template"]["spec"]["containers"]
    assert "llm-d.ai/role" not in vllm["spec"]["selector"]["matchLabels"]
    assert "--kv-transfer-config" not in container["args"] and "env" not in container
    table = tomllib.loads(config_toml(plain))["backends"]["vllm"]
    assert table["base_url"] == "http://gw-llm-gateway-vllm:8000" and "prefill_endpoints" not in table
    assert len(by_kind(plain, "Deployment")) == 2 and {"gw-llm-gateway", "gw-llm-gateway-vllm"} == {
        d["metadata"]["name"] for d in by_kind(plain, "Service")}
    assert len(policy_rules(plain, "gw-llm-gateway-vllm")) == 1


def gateway_shm(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    pod = pods(docs)["gw-llm-gateway"]["spec"]["template"]["spec"]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    if not mounts:
        return None
    return volumes[mounts[0]["name"]]["emptyDir"]


def test_engine_disaggregation_renders_the_worker_roles_and_a_memory_backed_dev_shm() -> None:
    docs = render(ENGINE_PD)
    table = tomllib.loads(config_toml(docs))["backends"]["local"]
    assert (table["type"], table["replicas"], table["prefill_replicas"], table["pd_threshold_tokens"]) == \
        ("engine", 3, 1, 512)
    assert "shmSize" not in table  # the chart's own key, not config.toml's
    # the KV handover between worker processes goes through /dev/shm: what one prefill worker's cache holds
    assert gateway_shm(docs) == {"medium": "Memory", "sizeLimit": "512Mi"}
    sized = render({"config": {"engine": {**ENGINE_PD["config"]["engine"], "replicas": 4, "prefill_replicas": 2,
                                          "kv_cache_mb": 1024}}})
    assert gateway_shm(sized) == {"medium": "Memory", "sizeLimit": "2048Mi"}
    explicit = render({"config": {"engine": {**ENGINE_PD["config"]["engine"], "shmSize": "3Gi"}}})
    assert gateway_shm(explicit) == {"medium": "Memory", "sizeLimit": "3Gi"}
    # a whole config.toml given in values: the chart cannot read it, so shmSize asks for the mount
    whole = render({"configToml": (ROOT / "config.toml").read_text(), "config": {"engine": {"shmSize": "1Gi"}}})
    assert gateway_shm(whole) == {"medium": "Memory", "sizeLimit": "1Gi"}
    # colocated (the default, or workers without roles): no /dev/shm volume, the pod as before
    assert gateway_shm(render({})) is None
    assert gateway_shm(render({"config": {"engine": {"enabled": True, "replicas": 2}}})) is None
    assert "prefill_replicas" not in tomllib.loads(config_toml(render({})))["backends"]["local"]


@pytest.mark.parametrize(("values", "message"), [
    ({"config": {"engine": {"enabled": True, "replicas": 2, "prefill_replicas": 2}}}, "at least one decode worker"),
    ({"config": {"engine": {"enabled": True, "prefill_replicas": 1}}}, "at least one decode worker"),
    ({"backends": {"vllm": {"enabled": True, "disaggregation": {"enabled": True, "sideChannelPort": 8000}}}},
     "sideChannelPort must differ"),
], ids=["all-prefill", "one-worker", "port-clash"])
def test_inconsistent_disaggregation_values_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmError, match=message):
        render(values)
