"""GET http(s) media under the url_guard policy: sync for the offline API, async for the server.

Every hop is parsed, allowlisted, resolved and address-checked, then connected to by the
checked address (Host header and TLS SNI keep the name), so DNS cannot change between the
check and the connection. The whole fetch, redirects included, has one deadline and one byte cap.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from urllib.parse import urljoin

import httpx

from mmserve.errors import MediaError, MediaFetchBusyError, MediaFetchRefusedError
from mmserve.processing.loop_semaphore import LoopSemaphore
from mmserve.processing.url_guard import (
    AllowedHost,
    IPAddress,
    MediaURL,
    check_addresses,
    check_allowlist,
    parse_media_url,
    pinned_url,
)

# socket.getaddrinfo's shape; tests pass a slow one to exercise the DNS deadline.
Resolver = Callable[..., Sequence[tuple]]


@dataclass(frozen=True)
class FetchPolicy:
    """What one fetch may do: where (allowlist), how long (all hops together), how many bytes.
    Built from a MediaConfig (`MediaLoader.fetch_policy`), which owns the defaults."""

    allowlist: tuple[AllowedHost, ...]
    timeout_s: float
    max_bytes: int
    max_redirects: int

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_bytes <= 0 or self.max_redirects < 0:
            raise ValueError(
                "FetchPolicy needs timeout_s > 0, max_bytes > 0 and max_redirects >= 0, got "
                f"{self.timeout_s}, {self.max_bytes}, {self.max_redirects}"
            )


def fetch_url(url: str, policy: FetchPolicy, resolver: Resolver = socket.getaddrinfo) -> bytes:
    """Blocking fetch (the offline API): the calling thread waits on DNS and the network."""
    deadline = time.monotonic() + policy.timeout_s
    current = url
    with _client(policy, httpx.Client) as client:
        for _ in range(policy.max_redirects + 1):
            target = parse_media_url(current)
            allowlisted = check_allowlist(target, policy.allowlist)
            addr = check_addresses(target, _resolve(resolver, target), allowlisted)
            try:
                with client.stream("GET", **_request(target, addr)) as resp:
                    location = _redirect_location(resp, current)
                    if location is not None:
                        current = location
                        continue
                    _check_response(resp, target, policy.max_bytes)
                    return _read_capped(resp.iter_bytes(), policy, deadline)
            except httpx.TimeoutException:
                raise _timed_out(policy.timeout_s) from None
            except httpx.HTTPError:
                raise _unreachable(target) from None
    raise _too_many_redirects(policy.max_redirects)


class AsyncFetcher:
    """Fetches on the event loop: no thread waits on the network, at most N fetches at once.

    CPU work (decoding, image processing) runs on the default executor; fetches never occupy
    it, so slow servers can delay only other fetches, never a data: or file:// request. DNS
    is the one blocking call; it runs on a pool of this fetcher's own, under the deadline.
    """

    def __init__(
        self,
        policy: FetchPolicy,
        max_concurrent: int,
        *,
        resolver: Resolver = socket.getaddrinfo,
    ) -> None:
        if max_concurrent <= 0:
            raise ValueError(f"max_concurrent_fetches must be positive, got {max_concurrent}")
        self.policy = policy
        self.max_concurrent = max_concurrent
        self._resolver = resolver
        self._dns = ThreadPoolExecutor(max_concurrent, thread_name_prefix="mmserve-dns")
        self._slots = LoopSemaphore(max_concurrent)

    async def fetch(self, url: str, max_bytes: int | None = None) -> bytes:
        """GET `url`; waits at most `timeout_s` for a free slot, then at most `timeout_s` more.
        `max_bytes`: this fetch's byte cap instead of the policy's (videos have their own)."""
        policy = self.policy if max_bytes is None else replace(self.policy, max_bytes=max_bytes)
        slots = self._slots.get()
        timeout_s = self.policy.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await slots.acquire()
        except TimeoutError:
            raise MediaFetchBusyError(
                f"all {self.max_concurrent} media fetch slots stayed busy for {timeout_s:g} s; "
                "retry later, send the image inline as a data: URL, or raise "
                "--max-concurrent-media-fetches",
                param="image_url",
            ) from None
        try:
            async with asyncio.timeout(timeout_s):
                return await self._fetch(url, policy)
        except TimeoutError:
            raise _timed_out(timeout_s) from None
        finally:
            slots.release()

    def close(self) -> None:
        self._dns.shutdown(wait=False, cancel_futures=True)

    async def _fetch(self, url: str, policy: FetchPolicy) -> bytes:
        current = url
        async with _client(policy, httpx.AsyncClient) as client:
            for _ in range(policy.max_redirects + 1):
                target = parse_media_url(current)
                allowlisted = check_allowlist(target, policy.allowlist)
                infos = await asyncio.get_running_loop().run_in_executor(
                    self._dns, functools.partial(_resolve, self._resolver, target)
                )
                addr = check_addresses(target, infos, allowlisted)
                try:
                    async with client.stream("GET", **_request(target, addr)) as resp:
                        location = _redirect_location(resp, current)
                        if location is not None:
                            current = location
                            continue
                        _check_response(resp, target, policy.max_bytes)
                        body = bytearray()
                        async for chunk in resp.aiter_bytes():
                            body += chunk
                            if len(body) > policy.max_bytes:
                                raise _too_big(policy.max_bytes)
                        return bytes(body)
                except httpx.TimeoutException:
                    raise _timed_out(policy.timeout_s) from None
                except httpx.HTTPError:
                    raise _unreachable(target) from None
        raise _too_many_redirects(policy.max_redirects)


def _client(policy: FetchPolicy, cls: type[httpx.Client] | type[httpx.AsyncClient]):
    # trust_env=False: no proxy or netrc from the environment may redirect a checked request.
    return cls(timeout=policy.timeout_s, follow_redirects=False, trust_env=False)


def _resolve(resolver: Resolver, url: MediaURL) -> Sequence[tuple]:
    try:
        return resolver(url.host, url.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise MediaError(
            f"image host {url.host!r} could not be resolved", param="image_url"
        ) from None


def _request(url: MediaURL, addr: IPAddress) -> dict:
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    return {
        "url": pinned_url(url, addr),
        "headers": {"Host": url.host_header},
        "extensions": extensions,
    }


def _redirect_location(resp: httpx.Response, current: str) -> str | None:
    if not resp.is_redirect:
        return None
    location = resp.headers.get("location")
    if not location:
        raise MediaError("image URL redirected without a Location header", param="image_url")
    return urljoin(current, location)


def _check_response(resp: httpx.Response, url: MediaURL, max_bytes: int) -> None:
    if resp.status_code != 200:
        raise MediaError(
            f"fetching the image from {url.host!r} returned HTTP {resp.status_code}",
            param="image_url",
        )
    declared = resp.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise _too_big(max_bytes)


def _read_capped(chunks: Iterator[bytes], policy: FetchPolicy, deadline: float) -> bytes:
    body = bytearray()
    for chunk in chunks:
        body += chunk
        if len(body) > policy.max_bytes:
            raise _too_big(policy.max_bytes)
        if time.monotonic() > deadline:  # a slow drip must not outlive the total timeout
            raise _timed_out(policy.timeout_s)
    return bytes(body)


def _too_big(max_bytes: int) -> MediaFetchRefusedError:
    return MediaFetchRefusedError(
        f"image is larger than the {max_bytes}-byte limit", param="image_url"
    )


def _timed_out(timeout_s: float) -> MediaError:
    return MediaError(f"fetching the image took longer than {timeout_s:g} s", param="image_url")


def _unreachable(url: MediaURL) -> MediaError:
    return MediaError(f"could not fetch the image from {url.host!r}", param="image_url")


def _too_many_redirects(max_redirects: int) -> MediaFetchRefusedError:
    return MediaFetchRefusedError(
        f"image URL redirected more than {max_redirects} times", param="image_url"
    )
