"""DNS discovery: every A/AAAA record of `base_url`'s host is a replica at the same scheme, port and
path. Behind a Kubernetes headless Service the records are the ready pods' IPs, so the kubelet's
readiness probes decide membership without any API access. The resolver is injectable: tests pass a
double (the pool is under test, not DNS)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

Resolver = Callable[[str], Awaitable[list[str]]]  # host → its addresses


async def resolve_host(host: str) -> list[str]:
    """The host's A and AAAA addresses, in the resolver's order, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for *_, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in seen:
            seen.append(address)
    return seen


def split_host(base_url: str) -> str:
    host = urlsplit(base_url).hostname
    if not host:
        raise ValueError(f"no host in base_url {base_url!r}")
    return host


def replica_url(base_url: str, address: str) -> str:
    """base_url with its host replaced by one address (IPv6 in brackets)."""
    parts = urlsplit(base_url)
    try:
        ipv6 = isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address)
    except ValueError:  # a name (a resolver may answer with names)
        ipv6 = False
    host = f"[{address}]" if ipv6 else address
    netloc = host + (f":{parts.port}" if parts.port else "")
    if parts.username:
        netloc = f"{parts.username}{':' + parts.password if parts.password else ''}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)).rstrip("/")


async def discover(base_url: str, resolver: Resolver) -> list[str]:
    return [replica_url(base_url, a) for a in await resolver(split_host(base_url))]
