"""SSRF policy for http(s) media URLs: strict parsing, the host:port allowlist, address checks."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

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
    problem = _host_problem(host)
    if problem:
        raise refused(f"image URL host {problem}")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return MediaURL(scheme=scheme, host=host, port=port, target=target, url=url)


def _host_problem(host: str) -> str | None:
    """Why a lower-case host (IPv6 without brackets) is not acceptable, or None when it is."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return "is an invalid IPv6 address"
    elif _ENDS_IN_NUMBER.search(host):
        # Only canonical dotted quads: 127.1, 0x7f.0.0.1 or 2130706433 are refused.
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return "is a malformed IP address"
    elif not _HOSTNAME.match(host):
        return "is not a valid hostname (IDNs must be punycode)"
    return None


# ---- the allowlist ------------------------------------------------------------------------
#
#   entry              allows
#   example.com        example.com on the scheme's default port (http 80, https 443) only
#   example.com:8080   example.com on port 8080 only (http or https)
#   10.0.0.5:9000      that address on port 9000 only
#   [::1]:9000  ::1    an IPv6 literal, with or without a port (brackets needed for a port)


@dataclass(frozen=True, slots=True)
class AllowedHost:
    """One --allowed-media-domains entry; `port` None means the scheme's default port."""

    host: str
    port: int | None = None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"

    def allows(self, url: MediaURL) -> bool:
        port = _DEFAULT_PORTS[url.scheme] if self.port is None else self.port
        return self.host == url.host and port == url.port


def parse_allowed_host(entry: str) -> AllowedHost:
    """Parse `host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 literal; ValueError if bad."""
    text = entry.strip().lower()
    port_text = None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(_bad_entry(entry, "an IPv6 entry looks like [::1] or [::1]:8080"))
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host = text  # a hostname, an IPv4 address or a bare IPv6 literal
    problem = _host_problem(host) if host else "is empty"
    if problem:
        raise ValueError(_bad_entry(entry, f"the host {problem}"))
    if port_text is None:
        return AllowedHost(host)
    if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise ValueError(_bad_entry(entry, "the port must be a number in 1..65535"))
    return AllowedHost(host, int(port_text))


def parse_allowlist(entries: Iterable[str]) -> tuple[AllowedHost, ...]:
    return tuple(dict.fromkeys(parse_allowed_host(e) for e in entries))


def _bad_entry(entry: str, why: str) -> str:
    return f"--allowed-media-domains entry {entry!r} is not host or host:port: {why}"


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
            f"{_DEFAULT_PORTS[url.scheme]} for {url.scheme}); add "
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
