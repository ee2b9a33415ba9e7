"""reference/metrics.md: every Prometheus metric of the registry a gateway builds."""

from __future__ import annotations

import tempfile
import types
from dataclasses import dataclass
from typing import Any

from reference_pages import markdown as md

# ---------------------------------------------------------------------------------------------------------------
# Metrics

# A gateway with every optional metric on: TGI's names, per-key series, [state] (keys, usage rows). Its one backend
# is never built: Gateway(backends={}) wires the registry as `llmgw serve` does, and starts nothing.
DOCS_CONFIG = """
[server]
tgi_metrics = true
metrics_per_key = true
[state]
database = "sqlite:///{directory}/state.db"
[backends.docs]
type = "openai"
base_url = "http://127.0.0.1:9"
model = "docs"
[models.docs]
backend = "docs"
"""


@dataclass(frozen=True)
class MetricDoc:
    name: str  # the family's name
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str
    exposed: str  # the series names on /metrics
    note: str = ""


GROUPS: list[tuple[str, tuple[str, ...], str]] = [
    ("Requests and tokens", (), "Every request the gateway answers, by model, backend and route."),
    ("Engine backends", ("llmgw_engine_",), "Series for each engine backend (each worker of an engine pool) once "
     "it has started; the `spec_decode` ones only while an engine speculates "
     "(`[backends.<name>.speculative]`)."),
    ("Backend health", ("llmgw_backend_",), "A series per backend, read at scrape time."),
    ("Replica pools", ("llmgw_replica_", "llmgw_balancer_", "llmgw_pd_"), "Series for backends that are pools "
     "(`endpoints`, `discovery = \"dns\"`, `replicas` > 1, prefill/decode pools)."),
    ("Per API key", ("llmgw_key_",), "Only with `server.metrics_per_key = true`; labelled by the key's name, "
     "never its secret, at most `server.max_key_series` names (the rest count under `other`)."),
    ("Limits and the state store", ("llmgw_limiter_", "llmgw_state_", "llmgw_usage_", "llmgw_responses_"),
     "The limiter's always; the state store's only with `[state]`, the usage rows' only with "
     "`state.record_usage`."),
    ("Rollouts", ("llmgw_rollout_",), "Series for each rollout in progress; the leader gauge always."),
    ("TGI-compatible names", ("tgi_",), "Only with `server.tgi_metrics = true`: TGI's own names, types and "
     "buckets (counters without `_total`, no help text), so dashboards built for TGI keep working."),
]


def _exposed(name: str, kind: str, created: bool) -> str:
    if kind == "counter":
        names = [f"{name}_total"] + ([f"{name}_created"] if created else [])
    elif kind == "histogram":
        names = [f"{name}_bucket", f"{name}_sum", f"{name}_count"] + ([f"{name}_created"] if created else [])
    else:
        names = [name]
    return ", ".join(names)


def _speculating_engine() -> Any:
    """A stand-in engine row for spec_decode_state: its families exist only while an engine speculates."""
    counters = types.SimpleNamespace(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, num_emitted_tokens=0,
                                     accepted_per_pos=[0], mean_acceptance_length=lambda: 0.0)
    spec = types.SimpleNamespace(config=types.SimpleNamespace(method="ngram"), counters=counters)
    return types.SimpleNamespace(spec=spec)


def metric_docs() -> list[MetricDoc]:
    """Every metric family of a gateway's registry (and its hand-written TGI set), each once."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.config import parse_config
    from gateway.state import Gateway
    from gateway.telemetry.metrics import spec_decode_state
    from gateway.telemetry.record import RequestRecord

    with tempfile.TemporaryDirectory() as directory:
        gateway = Gateway(parse_config(DOCS_CONFIG.format(directory=directory)), backends={})
        registry = gateway.metrics.registry
        labels: dict[str, tuple[str, ...]] = {}  # the labels of registered metric objects, by family name
        for collector, names in registry._collector_to_names.items():
            for name in names:
                labels[name] = tuple(getattr(collector, "_labelnames", ()))
        out: list[MetricDoc] = []
        seen: set[str] = set()

        def add(families: Any, created: bool, note: str = "") -> None:
            for family in families:
                if family.name in seen:
                    continue
                seen.add(family.name)
                names = getattr(family, "_labelnames", None) or labels.get(family.name, ())
                if not names:
                    names = tuple(dict.fromkeys(k for s in family.samples for k in s.labels if k != "le"))
                own = created and family.name in labels  # metric objects expose _created; scrape-time families not
                out.append(MetricDoc(family.name, family.type, tuple(names), family.documentation,
                                     _exposed(family.name, family.type, own), note))

        add(registry.collect(), created=True)
        add(spec_decode_state([("docs", _speculating_engine())]), created=False,
            note="only while an engine speculates")
        tgi = gateway.metrics.tgi
        tgi.observe(RequestRecord("docs", "POST", "/generate", model="docs", status=422))  # a failure: its label
        for family in text_string_to_metric_families(tgi.render().decode()):
            if family.name not in seen:
                seen.add(family.name)
                names = tuple(dict.fromkeys(k for s in family.samples for k in s.labels if k != "le"))
                exposed = (family.name if family.type != "histogram" else
                           f"{family.name}_bucket, {family.name}_sum, {family.name}_count")
                out.append(MetricDoc(family.name, family.type, names, family.documentation, exposed))
    return out


def _series(d: MetricDoc) -> str:
    """The exposed names, short: `x_bucket`, `_sum`, `_count` (no `_created`: the page's intro says which)."""
    names = [n for n in d.exposed.split(", ") if not n.endswith("_created")]
    return ", ".join([md.code(names[0]), *(md.code(n.removeprefix(d.name)) for n in names[1:])])


def _group(name: str) -> str:
    for title, prefixes, _ in GROUPS[1:]:
        if name.startswith(prefixes):
            return title
    return GROUPS[0][0]


def metrics_reference() -> str:
    docs = metric_docs()
    lines = ["# Metrics reference", "",
             "Generated from the Prometheus registry a gateway builds (`gateway/state.py` `Gateway`, "
             "`gateway/telemetry/`, `gateway/rollout/manager.py`), here one with `server.tgi_metrics`, "
             "`server.metrics_per_key` and `[state]` on and no backend started, so every family is listed "
             "although many have series only once backends run and requests come. Every metric is on "
             "`GET /metrics` (with `[auth] protect_metrics`, behind a key).", "",
             "Counters are exposed with `_total` and histograms as `_bucket`, `_sum` and `_count` (TGI's names "
             "excepted). The counters and histograms that count as requests go also have prometheus_client's "
             "`_created` timestamp series; the figures read at scrape time (engines, pools' replicas, limits, "
             "state store, rollouts) do not.", ""]
    for title, _, note in GROUPS:
        rows = [[_series(d), d.type, ", ".join(md.code(label) for label in d.labels) or "-",
                 md.cell(d.help + (f" ({d.note})" if d.note else "")) or "-"] for d in docs if _group(d.name) == title]
        if not rows:
            continue
        lines += [f"## {title}", "", md.cell(note), ""]
        lines += md.table(["Name", "Type", "Labels", "Help"], rows) + [""]
    return "\n".join(lines)


