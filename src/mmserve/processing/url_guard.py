"""SSRF-safe fetching of http(s) media URLs: strict parsing, address checks, pinned connections."""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from mmserve.errors import MediaError, MediaFetchRefusedError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Only plain ASCII hostnames (IDNs must come punycoded); no userinfo, no percent escapes.
_HOSTNAME = re.compile(
    r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$"
)
# WHATWG "ends in a number": such hosts are IPv4 in some form (127.1, 0x7f.1, 2130706433).
_ENDS_IN_NUMBER = re.compile(r"(?:^|\.)(?:[0-9]+|0x[0-9a-f]*)\.?$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class MediaURL:
    """A parsed http(s) URL whose host has been validated (not yet resolved)."""

    scheme: str
    host: str  # lower-case hostname, or an IP literal without brackets
    port: int
    target: str  # path + query, never empty
    url: str

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == _DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


def parse_media_url(url: str) -> MediaURL:
    """Parse an http(s) URL strictly; refuse anything a lenient parser could read two ways."""
    refused = MediaFetchRefusedError
    if any(ch in url for ch in "\\\t\r\n ") or not url.isascii() or not url.isprintable():
        raise refused("image URL contains a backslash, whitespace or non-ASCII character")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise refused(f"image URL scheme {parts.scheme!r} is not supported; use http or https")
    netloc = parts.netloc
    if "@" in netloc or "%" in netloc:
        raise refused("image URL must not contain user info or percent escapes in the host")
    if not url.lower().startswith(f"{scheme}://"):
        raise refused("image URL must start with http:// or https://")
    try:
        host = (parts.hostname or "").lower()
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        raise refused("image URL has an invalid port") from None
    if not host:
        raise refused("image URL has no host")
    if ":" in host:  # bracketed IPv6 literal
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise refused("image URL has an invalid IPv6 address") from None
    elif _ENDS_IN_NUMBER.search(host):
        # Only canonical dotted quads: 127.1, 0x7f.0.0.1 or 2130706433 are refused.
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise refused("image URL host is a malformed IP address") from None
    elif not _HOSTNAME.match(host):
        raise refused("image URL host is not a valid hostname (IDNs must be punycode)")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return MediaURL(scheme=scheme, host=host, port=port, target=target, url=url)


def _is_public(addr: IPAddress) -> bool:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return not (
        addr.is_loopback
        or addr.is_private
        or addr.is_link_local
        or addr.is_multicast
        or addr.is_reserved
        or addr.is_unspecified
        or not addr.is_global
    )


def resolve_checked(url: MediaURL, allowed_domains: tuple[str, ...]) -> IPAddress:
    """The address to connect to: allowlist first, then every resolved address must be public.

    An allowlisted host may resolve to a private address (an operator's own media server).
    All answers are checked, not just the first, so a mixed DNS answer cannot slip one through.
    """
    allowlisted = url.host in allowed_domains
    if allowed_domains and not allowlisted:
        raise MediaFetchRefusedError(
            f"image host {url.host!r} is not in --allowed-media-domains", param="image_url"
        )
    try:
        infos = socket.getaddrinfo(url.host, url.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise MediaError(f"image host {url.host!r} could not be resolved") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise MediaError(f"image host {url.host!r} could not be resolved")
    if not allowlisted:
        for addr in addresses:
            if not _is_public(addr):
                raise MediaFetchRefusedError(
                    f"image host {url.host!r} resolves to a non-public address; fetching from "
                    "loopback, private, link-local, multicast or reserved addresses needs the "
                    "host in --allowed-media-domains",
                    param="image_url",
                )
    return addresses[0]


def fetch_url(
    url: str,
    *,
    allowed_domains: tuple[str, ...],
    timeout_s: float,
    max_bytes: int,
    max_redirects: int,
) -> bytes:
    """GET an http(s) URL with every hop checked, connecting only to the checked address."""
    deadline = time.monotonic() + timeout_s
    current = url
    with httpx.Client(timeout=timeout_s, follow_redirects=False, trust_env=False) as client:
        for _ in range(max_redirects + 1):
            target = parse_media_url(current)
            addr = resolve_checked(target, allowed_domains)
            host = f"[{addr}]" if addr.version == 6 else str(addr)
            pinned = f"{target.scheme}://{host}:{target.port}{target.target}"
            extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
            try:
                with client.stream(
                    "GET", pinned, headers={"Host": target.host_header}, extensions=extensions
                ) as resp:
                    if resp.is_redirect:
                        location = resp.headers.get("location")
                        if not location:
                            raise MediaError("image URL redirected without a Location header")
                        current = urljoin(current, location)
                        continue
                    if resp.status_code != 200:
                        raise MediaError(
                            f"fetching the image from {target.host!r} returned HTTP "
                            f"{resp.status_code}"
                        )
                    declared = resp.headers.get("content-length")
                    if declared and declared.isdigit() and int(declared) > max_bytes:
                        raise _too_big(max_bytes)
                    return _read_capped(resp.iter_bytes(), max_bytes, deadline, timeout_s)
            except httpx.TimeoutException:
                raise _timed_out(timeout_s) from None
            except httpx.HTTPError:
                raise MediaError(f"could not fetch the image from {target.host!r}") from None
    raise MediaFetchRefusedError(f"image URL redirected more than {max_redirects} times")


def _read_capped(chunks: Iterator[bytes], max_bytes: int, deadline: float, timeout_s: float):
    body = bytearray()
    for chunk in chunks:
        body += chunk
        if len(body) > max_bytes:
            raise _too_big(max_bytes)
        if time.monotonic() > deadline:  # a slow drip must not outlive the total timeout
            raise _timed_out(timeout_s)
    return bytes(body)


def _too_big(max_bytes: int) -> MediaFetchRefusedError:
    return MediaFetchRefusedError(f"image is larger than the {max_bytes}-byte limit")


def _timed_out(timeout_s: float) -> MediaError:
    return MediaError(f"fetching the image took longer than {timeout_s:g} s")
