"""The Helm chart's `state` values (issue 34): the schema migrated by a hook Job before any pod starts, the
database and Redis URLs read from the user's Secrets (never the ConfigMap), and inconsistent values refused."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest
from helm_python import HelmError

from tests.helm_chart import STATE, STATE_ENV, by_kind, config_toml, pods, render
from tests.server import ROOT


def state_job(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    jobs = by_kind(docs, "Job")
    assert len(jobs) <= 1
    return jobs[0] if jobs else None


def gateway_env(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    container = pods(docs)["gw-llm-gateway"]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in container.get("env", [])}


def test_state_migrates_in_a_hook_job_and_the_pods_read_the_urls_from_the_secrets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(STATE)
    from_secret = {"secretKeyRef": {"name": "llm-state", "key": "DATABASE_URL"}}
    redis_from_secret = {"secretKeyRef": {"name": "llm-state", "key": "REDIS_URL"}}
    # the schema, before any pod of the release starts or rolls
    job = state_job(docs)
    assert job is not None and job["metadata"]["name"] == "gw-llm-gateway-state-migrate"
    assert job["metadata"]["annotations"] == {"helm.sh/hook": "pre-install,pre-upgrade", "helm.sh/hook-weight": "-5",
                                              "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded"}
    assert (job["spec"]["backoffLimit"], job["spec"]["activeDeadlineSeconds"]) == (3, 300)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert container["image"] == pods(docs)["gw-llm-gateway"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert container["args"] == ["state", "migrate", "--database-env", "LLMGW_STATE_DATABASE"]  # after `llmgw`
    assert container["env"] == [{"name": "LLMGW_STATE_DATABASE", "valueFrom": from_secret}]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["limits"]["memory"] == "256Mi"
    # a pre-install hook runs before the chart's ConfigMap and Secret exist: it must not need them
    assert [v for v in pod["volumes"] if set(v) & {"configMap", "secret", "projected"}] == []
    chart_made = {d["metadata"]["name"] for d in docs if d["kind"] in ("ConfigMap", "Secret")}
    assert not chart_made & {from_secret["secretKeyRef"]["name"]}
    # no Service, PDB or NetworkPolicy of the chart takes the Job's pod for a gateway; nothing limits its egress
    labels = job["spec"]["template"]["metadata"]["labels"]
    selectors = [d["spec"]["selector"] for d in by_kind(docs, "Service")]
    selectors += [d["spec"]["selector"]["matchLabels"] for d in by_kind(docs, "PodDisruptionBudget")]
    selectors += [d["spec"]["podSelector"]["matchLabels"] for d in by_kind(docs, "NetworkPolicy")]
    assert selectors and not any(sel.items() <= labels.items() for sel in selectors)
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in by_kind(docs, "NetworkPolicy"))
    # the gateway: both URLs from the Secrets, named in config.toml, never in the ConfigMap
    env = gateway_env(docs)
    assert env["LLMGW_STATE_DATABASE"] == {"name": "LLMGW_STATE_DATABASE", "valueFrom": from_secret}
    assert env["LLMGW_STATE_REDIS"] == {"name": "LLMGW_STATE_REDIS", "valueFrom": redis_from_secret}
    assert "LLMGW_ADMIN_KEY" in env  # the auth env block is kept alongside
    text = config_toml(docs)
    assert tomllib.loads(text)["state"] == {
        "database_env": "LLMGW_STATE_DATABASE", "redis_env": "LLMGW_STATE_REDIS", "fail_open": True,
        "auto_migrate": False, "record_usage": True, "log_content": False, "responses_ttl": 604800,
        "usage_flush_interval": 0.5}
    from gateway.config import parse_config

    for name, value in STATE_ENV.items():
        monkeypatch.setenv(name, value)
    state = parse_config(text).state
    assert state is not None and state.auto_migrate is False  # the Job migrated: pods only check the schema
    assert (state.resolved_database(), state.resolved_redis()) == (STATE_ENV["LLMGW_STATE_DATABASE"],
                                                                   STATE_ENV["LLMGW_STATE_REDIS"])
    assert (state.responses_ttl, state.usage_flush_interval) == (604800.0, 0.5)


def test_state_without_the_migration_job_lets_each_pod_migrate_at_start() -> None:
    values = {"state": {"enabled": True, "migrate": False, "database": "postgresql://llmgw@pg:5432/llmgw",
                        "failOpen": False}}
    docs = render(values)
    assert state_job(docs) is None
    table = tomllib.loads(config_toml(docs))["state"]
    assert (table["auto_migrate"], table["fail_open"]) == (True, False)
    assert "redis_env" not in table  # no Redis: each replica counts its limits alone
    # a URL without a password is given as a value; only the [state] variables (no auth ones)
    assert gateway_env(docs) == {"LLMGW_STATE_DATABASE": {"name": "LLMGW_STATE_DATABASE",
                                                          "value": "postgresql://llmgw@pg:5432/llmgw"}}
    migrated = render({"state": {**values["state"], "migrate": True, "redis": "redis://r:6379/0"}})
    job = state_job(migrated)
    assert job is not None
    assert job["spec"]["template"]["spec"]["containers"][0]["env"] == [
        {"name": "LLMGW_STATE_DATABASE", "value": "postgresql://llmgw@pg:5432/llmgw"}]  # the database only
    assert gateway_env(migrated)["LLMGW_STATE_REDIS"] == {"name": "LLMGW_STATE_REDIS", "value": "redis://r:6379/0"}
    # state off (the default): no Job, no [state], no state variables
    plain = render({})
    assert state_job(plain) is None and "state" not in tomllib.loads(config_toml(plain))
    assert gateway_env(plain) == {}


def test_state_with_a_whole_config_given_in_values_still_gets_its_environment_and_job() -> None:
    text = (ROOT / "config.toml").read_text()
    docs = render({"configToml": text, "state": STATE["state"]})
    assert config_toml(docs).strip() == text.strip()  # used as is (its [state], if any, names the variables)
    assert {"LLMGW_STATE_DATABASE", "LLMGW_STATE_REDIS"} <= set(gateway_env(docs))
    assert state_job(docs) is not None


@pytest.mark.parametrize(("values", "message"), [
    ({"state": {"enabled": True}}, "state.enabled needs the database"),
    ({"state": {"enabled": True, "redis": "redis://r:6379/0"}}, "state.enabled needs the database"),
    ({"state": {"enabled": True, "migrate": False}}, "state.enabled needs the database"),
    ({"state": {"enabled": True, "database": "postgresql://u@h/db", "existingSecret": "db"}}, "not both"),
    ({"state": {"enabled": True, "existingSecret": "db", "redis": "redis://r:6379/0", "redisExistingSecret": "r"}},
     "not both"),
    ({"state": {"enabled": True, "database": "postgresql://u:hunter2@h/db"}}, "state.database carries a password"),
    ({"state": {"enabled": True, "existingSecret": "db", "redis": "redis://:hunter2@r:6379/0"}},
     "state.redis carries a password"),
], ids=["no-database", "redis-only", "no-database-no-job", "database-twice", "redis-twice", "database-password",
        "redis-password"])
def test_inconsistent_state_values_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmError, match=message):
        render(values)
