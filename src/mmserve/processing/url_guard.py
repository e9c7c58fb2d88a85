"""SSRF policy for http(s) media URLs: strict parsing, the host:port allowlist, address checks."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from mmserve.config.allowlist import DEFAULT_PORTS, AllowedHost, host_problem
from mmserve.errors import MediaError, MediaFetchRefusedError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


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
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


def parse_media_url(url: str) -> MediaURL:
    """Parse an http(s) URL strictly; refuse anything a lenient parser could read two ways."""
    refused = MediaFetchRefusedError
    if any(ch in url for ch in "\\\t\r\n ") or not url.isascii() or not url.isprintable():
        raise refused("image URL contains a backslash, whitespace or non-ASCII character")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise refused(f"image URL scheme {parts.scheme!r} is not supported; use http or https")
    netloc = parts.netloc
    if "@" in netloc or "%" in netloc:
        raise refused("image URL must not contain user info or percent escapes in the host")
    if not url.lower().startswith(f"{scheme}://"):
        raise refused("image URL must start with http:// or https://")
    try:
        host = (parts.hostname or "").lower()
        port = parts.port or DEFAULT_PORTS[scheme]
    except ValueError:
        raise refused("image URL has an invalid port") from None
    if not host:
        raise refused("image URL has no host")
    problem = host_problem(host)
    if problem:
        raise refused(f"image URL host {problem}")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return MediaURL(scheme=scheme, host=host, port=port, target=target, url=url)


def check_allowlist(url: MediaURL, allowlist: Sequence[AllowedHost]) -> bool:
    """True when the allowlist names this host and port; refuse when a non-empty list does not.

    An empty allowlist means any public host on any port (the address check still applies).
    """
    if not allowlist:
        return False
    if any(entry.allows(url) for entry in allowlist):
        return True
    if any(entry.host == url.host for entry in allowlist):
        listed = ", ".join(str(e) for e in allowlist if e.host == url.host)
        raise MediaFetchRefusedError(
            f"image URL port {url.port} is not allowed for host {url.host!r}: "
            f"--allowed-media-domains lists it as {listed} (a bare host means port "
            f"{DEFAULT_PORTS[url.scheme]} for {url.scheme}); add "
            f"'{AllowedHost(url.host, url.port)}' to allow that port",
            param="image_url",
        )
    raise MediaFetchRefusedError(
        f"image host {url.host!r} is not in --allowed-media-domains", param="image_url"
    )


# ---- addresses ----------------------------------------------------------------------------


def check_addresses(url: MediaURL, infos: Sequence[tuple], allowlisted: bool) -> IPAddress:
    """The address to connect to, from getaddrinfo's answer: every address must be public.

    An allowlisted host may resolve to a private address (an operator's own media server).
    All answers are checked, not just the first, so a mixed DNS answer cannot slip one through.
    """
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise MediaError(f"image host {url.host!r} could not be resolved", param="image_url")
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


def pinned_url(url: MediaURL, addr: IPAddress) -> str:
    """The URL to request: the checked address in place of the name (Host and SNI keep it)."""
    host = f"[{addr}]" if addr.version == 6 else str(addr)
    return f"{url.scheme}://{host}:{url.port}{url.target}"


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
