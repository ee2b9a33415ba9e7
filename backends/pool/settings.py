"""The config fields that make one backend a pool of replicas, shared by every HTTP backend type.

A backend with one `base_url` and no discovery is not a pool: it is built as before. `endpoints`
(a fixed list) or `discovery = "dns"` (every A/AAAA record of `base_url`'s host is a replica) make
it one. The balancing rule and its defaults are explained in `backends/pool/balance.py`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

BalancePolicy = Literal["round_robin", "least_load", "prefix"]
# uncached prompt tokens from which prefill goes to a prefill replica, for engine workers and vLLM pools alike;
# docs/benchmarks.md "Prefill/decode disaggregation" says where this comes from
PD_THRESHOLD_TOKENS = 128


class PoolFields(msgspec.Struct, frozen=True, kw_only=True):
    """Pool keys of every HTTP backend type: replicas, discovery, balancing, scraping, prefill/decode."""

    endpoints: list[str] = []
    """Replicas' base URLs; or base_url with discovery = "dns"."""
    discovery: Literal["static", "dns"] = "static"
    """Where the replicas come from: "static", `endpoints` (or the one `base_url`); "dns", every A/AAAA record
    of base_url's host, re-resolved every dns_interval seconds."""
    dns_interval: float = 10.0
    """Seconds between re-resolutions of base_url's host."""
    balance: BalancePolicy = "prefix"
    """Which replica gets a request (backends/pool/balance.py): "prefix" (prompt-prefix affinity, unless the
    load is imbalanced), "least_load" or "round_robin"."""
    balance_abs_threshold: float = 8.0
    """Load imbalance gate of the prefix policy (SGLang router's rule: both must hold to ignore affinity): max
    load - min load over this..."""
    balance_rel_threshold: float = 1.5
    """...and max load over this many times min load."""
    cache_threshold: float = 0.3
    """Matched share of the prompt's blocks that counts as a prefix hit."""
    prefix_block_tokens: int = 16
    """Block size of the prefix index, in tokens (as vLLM's default block size)..."""
    prefix_block_chars: int = 64
    """...or, for text the gateway did not tokenize, characters per block."""
    prefix_max_blocks: int = 256
    """Blocks hashed per prompt at most (llm-d's maxPrefixBlocksToMatch)."""
    prefix_capacity: int = 31250
    """Blocks remembered per replica, least recently used evicted first."""
    scrape_interval: float = 1.0
    """Seconds between /metrics scrapes of each replica; 0: no scraping."""
    scrape_path: str = "/metrics"
    """The path scraped on each replica for its load (waiting, running, KV usage)."""
    metrics_port: int | None = None
    """Scrape another port than the replica's (Triton serves metrics on 8002); None: the replica's port."""
    stale_after: float | None = None
    """Scraped figures older than this many seconds are ignored; default: 3 scrape intervals."""
    eject_after_failures: int = 3
    """Consecutive failures that take one replica out (for eject_cooldown seconds)."""
    eject_cooldown: float = 30.0
    """Seconds a replica stays out after eject_after_failures consecutive failures."""
    prefill_endpoints: list[str] = []
    """Prefill/decode disaggregation (backends/pool/disaggregated.py): the prefill pool's URLs, instead of
    `base_url`/`endpoints` (with discovery = "dns", every address of each URL's host is a prefill replica)."""
    decode_endpoints: list[str] = []
    """Prefill/decode disaggregation: the decode pool's URLs (with discovery = "dns", every address of each URL's
    host is a decode replica)."""
    pd_threshold_tokens: int = PD_THRESHOLD_TOKENS
    """Uncached prompt tokens from which prefill goes to a prefill replica."""
    prefill_timeout: float = 60.0
    """Seconds for the prefill leg before the decode replica prefills itself."""

    @property
    def is_pool(self) -> bool:
        return bool(self.endpoints) or self.discovery == "dns" or self.disaggregated

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_endpoints or self.decode_endpoints)

    def pd_refusal(self) -> str | None:
        """Why this backend type cannot run prefill/decode legs (None: it can). A type that relays a KV
        connector's handover says so by overriding this; the others refuse the keys at config load."""
        return (f"type {getattr(self, 'type', '?')!r} cannot run prefill/decode legs: only type \"openai\" with "
                "flavor \"vllm\" relays vLLM's kv_transfer_params")

    def check_pool(self, base_url: str) -> None:
        """Raised errors become config errors at the backend's table."""
        if self.disaggregated:
            self._check_disaggregated(base_url)
        elif self.endpoints and base_url:
            raise ValueError("give either `base_url` or `endpoints`, not both")
        elif not self.endpoints and not base_url:
            raise ValueError("`base_url` or `endpoints` is required")
        elif self.discovery == "dns" and not base_url:
            raise ValueError("discovery = \"dns\" resolves `base_url`'s host: give `base_url`, not `endpoints`")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError("`endpoints` lists one URL twice")
        for key in ("dns_interval", "balance_rel_threshold", "eject_cooldown"):
            if getattr(self, key) <= 0:
                raise ValueError(f"`{key}` must be > 0")
        for key in ("prefix_block_tokens", "prefix_block_chars", "prefix_max_blocks", "prefix_capacity",
                    "eject_after_failures"):
            if getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be >= 1")
        if self.scrape_interval < 0 or self.balance_abs_threshold < 0 or not 0 <= self.cache_threshold <= 1:
            raise ValueError("`scrape_interval` and `balance_abs_threshold` must be >= 0, "
                             "`cache_threshold` in [0, 1]")

    def _check_disaggregated(self, base_url: str) -> None:
        refusal = self.pd_refusal()
        if refusal:
            raise ValueError(refusal)
        if not (self.prefill_endpoints and self.decode_endpoints):
            raise ValueError("give both `prefill_endpoints` and `decode_endpoints`, or neither")
        if base_url or self.endpoints:
            raise ValueError("`prefill_endpoints`/`decode_endpoints` replace `base_url` and `endpoints`: give one way")
        both = [*self.prefill_endpoints, *self.decode_endpoints]
        if len(set(both)) != len(both):  # a replica has one role: the KV goes from one to another
            raise ValueError("a URL is listed twice in `prefill_endpoints` and `decode_endpoints`")
        if self.pd_threshold_tokens < 0 or self.prefill_timeout <= 0:
            raise ValueError("`pd_threshold_tokens` must be >= 0 and `prefill_timeout` > 0")

    def describe(self) -> str:
        """What `llmgw check-config` prints of the backend: its replicas and how they are balanced."""
        base_url = getattr(self, "base_url", "")
        if self.disaggregated:
            return self._describe_disaggregated()
        if not self.is_pool:
            return f"one server, {base_url}"
        if self.discovery == "dns":
            replicas = f"a pool of every address of {base_url}'s host, resolved every {self.dns_interval:g} s"
        else:
            replicas = f"a pool of {len(self.endpoints)} replicas ({', '.join(self.endpoints)})"
        rule = self.balance
        if self.balance == "prefix":
            rule += (f" (the replica holding >= {self.cache_threshold:g} of the prompt's blocks, unless loads differ "
                     f"by > {self.balance_abs_threshold:g} requests and > {self.balance_rel_threshold:g}x "
                     "while the busiest has requests waiting)")
        scrape = (f"{self.scrape_path} scraped every {self.scrape_interval:g} s" if self.scrape_interval
                  else "no scraping (this gateway's own counts only)")
        return (f"{replicas}; balance {rule}; {scrape}; a replica is ejected after {self.eject_after_failures} "
                f"failures, for {self.eject_cooldown:g} s")

    def _describe_disaggregated(self) -> str:
        if self.discovery == "dns":
            roles = [f"every address of {url}'s host as {role}" for role, urls in
                     (("prefill", self.prefill_endpoints), ("decode", self.decode_endpoints)) for url in urls]
            replicas = f"prefill/decode pools of {'; '.join(roles)} (resolved every {self.dns_interval:g} s)"
        else:
            roles = [f"{url} prefill" for url in self.prefill_endpoints]
            roles += [f"{url} decode" for url in self.decode_endpoints]
            replicas = "prefill/decode pools: " + ", ".join(roles)
        return (f"{replicas}; prefill balanced by prefix, decode by least load; prefill goes remote from "
                f"{self.pd_threshold_tokens} uncached prompt tokens (else the decode replica prefills), its leg "
                f"times out after {self.prefill_timeout:g} s")

    @property
    def stale_seconds(self) -> float:
        return self.stale_after if self.stale_after is not None else 3 * self.scrape_interval
