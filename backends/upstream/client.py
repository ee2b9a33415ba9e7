"""The pooled HTTP client of one upstream (a backend, or a replica of a pool): aiohttp's, used directly.

httpx over aiohttp's pool (httpx-aiohttp) cost about 0.17 ms and half the saturated rate of a bare proxy
here: its URL parsing, request and header models run on every request (benchmarks/gateway_overhead.py).
The session is made on first use, inside the running event loop, as aiohttp wants.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec

UpstreamError = aiohttp.ClientError  # what a broken connection or answer raises (timeouts raise TimeoutError)
ConnectError = aiohttp.ClientConnectorError


class UpstreamClient:
    def __init__(self, base_url: str, headers: dict[str, str], connect_timeout: float, total_timeout: float,
                 max_connections: int) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = headers
        self.connect_timeout = connect_timeout
        self.timeout = aiohttp.ClientTimeout(total=total_timeout, sock_connect=connect_timeout)
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers, timeout=self.timeout,
                                                  auto_decompress=True)
        return self._session

    @asynccontextmanager
    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST and yield the response once its head arrived; its body is read (or streamed) by the caller."""
        async with self.session.post(self.base_url + path, data=body, headers=headers) as response:
            yield response

    async def get_json(self, path: str) -> tuple[int, Any]:
        """(status, decoded JSON body or None) of a GET, within the connect timeout."""
        timeout = aiohttp.ClientTimeout(total=self.connect_timeout)
        async with self.session.get(self.base_url + path, timeout=timeout) as response:
            body = await response.read()
        try:
            return response.status, msgspec.json.decode(body)
        except msgspec.DecodeError:
            return response.status, None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
