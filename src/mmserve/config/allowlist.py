"""The --allowed-media-domains syntax: `host`, `host:port` or an IPv6 literal, checked once."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

# Only plain ASCII hostnames (IDNs must come punycoded); no userinfo, no percent escapes.
_HOSTNAME = re.compile(
    r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$"
)
# WHATWG "ends in a number": such hosts are IPv4 in some form (127.1, 0x7f.1, 2130706433).
_ENDS_IN_NUMBER = re.compile(r"(?:^|\.)(?:[0-9]+|0x[0-9a-f]*)\.?$")
DEFAULT_PORTS = {"http": 80, "https": 443}


class _Url(Protocol):
    """What an entry compares against: a parsed URL's scheme, host and port."""

    scheme: str
    host: str
    port: int


def host_problem(host: str) -> str | None:
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

    def allows(self, url: _Url) -> bool:
        port = DEFAULT_PORTS[url.scheme] if self.port is None else self.port
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
    problem = host_problem(host) if host else "is empty"
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
