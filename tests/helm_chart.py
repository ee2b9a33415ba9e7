"""Rendering the Helm chart with Helm itself (helm-python-sdk embeds Helm's Go library), and the values and
lookups the chart's tests share."""

from __future__ import annotations

from typing import Any

import yaml
from helm_python import Chart

from tests.server import ROOT

CHART = ROOT / "helm" / "llm-gateway"
# [state] (issue 34): the database and Redis URLs from the user's Secrets, the schema migrated by a hook Job
STATE = {"state": {"enabled": True, "existingSecret": "llm-state", "redisExistingSecret": "llm-state",
                   "settings": {"record_usage": True, "log_content": False, "responses_ttl": 604800,
                                "usage_flush_interval": 0.5}},
         "auth": {"adminKey": "admin-secret-key"}}
# what Kubernetes would put in the pods' environment from those Secrets (config validation reads them)
STATE_ENV = {"LLMGW_STATE_DATABASE": "postgresql://u@h/db", "LLMGW_STATE_REDIS": "redis://h:6379/0"}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = Chart.load(CHART)
    manifests = chart.render(values, name="gw", namespace="llm", is_install=True)
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def config_toml(docs: list[dict[str, Any]]) -> str:
    (config,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    return config["data"]["config.toml"]


def pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
