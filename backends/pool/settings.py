"""The config fields that make one backend a pool of replicas, shared by every HTTP backend type.

A backend with one `base_url` and no discovery is not a pool: it is built as before. `endpoints`
(a fixed list) or `discovery = "dns"` (every A/AAAA record of `base_url`'s host is a replica) make
it one. The balancing rule and its defaults are explained in `backends/pool/balance.py`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

BalancePolicy = Literal["round_robin", "least_load", "prefix"]


class PoolFields(msgspec.Struct, frozen=True, kw_only=True):
    endpoints: list[str] = []  # replicas' base URLs; or base_url with discovery = "dns"
    discovery: Literal["static", "dns"] = "static"
    dns_interval: float = 10.0  # seconds between re-resolutions of base_url's host
    balance: BalancePolicy = "prefix"
    # load imbalance gate of the prefix policy (SGLang router's rule: both must hold to ignore affinity)
    balance_abs_threshold: float = 8.0  # max load - min load over this...
    balance_rel_threshold: float = 1.5  # ...and max load over this many times min load
    cache_threshold: float = 0.3  # matched share of the prompt's blocks that counts as a prefix hit
    prefix_block_tokens: int = 16  # block size of the prefix index (as vLLM's default block size)...
    prefix_block_chars: int = 64  # ...or, for text the gateway did not tokenize, characters per block
    prefix_max_blocks: int = 256  # blocks hashed per prompt at most (llm-d's maxPrefixBlocksToMatch)
    prefix_capacity: int = 31250  # blocks remembered per replica, least recently used evicted first
    scrape_interval: float = 1.0  # seconds between /metrics scrapes of each replica; 0: no scraping
    scrape_path: str = "/metrics"
    metrics_port: int | None = None  # scrape another port than the replica's (Triton serves metrics on 8002)
    stale_after: float | None = None  # scraped figures older than this are ignored; default 3 scrape intervals
    eject_after_failures: int = 3  # consecutive failures that take one replica out...
    eject_cooldown: float = 30.0  # ...for this many seconds

    @property
    def is_pool(self) -> bool:
        return bool(self.endpoints) or self.discovery == "dns"

    def check_pool(self, base_url: str) -> None:
        """Raised errors become config errors at the backend's table."""
        if self.endpoints and base_url:
            raise ValueError("give either `base_url` or `endpoints`, not both")
        if not self.endpoints and not base_url:
            raise ValueError("`base_url` or `endpoints` is required")
        if self.discovery == "dns" and not base_url:
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

    def describe(self) -> str:
        """What `llmgw check-config` prints of the backend: its replicas and how they are balanced."""
        base_url = getattr(self, "base_url", "")
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

    @property
    def stale_seconds(self) -> float:
        return self.stale_after if self.stale_after is not None else 3 * self.scrape_interval
