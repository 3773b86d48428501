"""Fetching a request's remote image or video (the gateway's --allow-remote-images): from hosts
at public addresses only, or, where the operator names hosts (--allowed-media-domains), from
those hosts only, wherever they are; every redirect is checked the same way. So a request cannot
make the gateway reach into its own network (a cloud's metadata service, Triton's ports, other
internal services), which a fetch of any URL would.

A host's addresses are checked before connecting, and the address a connection reached again
after it (a name may resolve differently the second time); through a proxy (the environment's
http_proxy/https_proxy), the connection's peer is the proxy and only the first check applies.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit


class NotAllowed(OSError):
    """A URL the gateway does not fetch, and why."""


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])  # an IPv6 scope id is not part of it
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global


def _addresses(host: str, port: int) -> list[str]:
    try:
        return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    except socket.gaierror as e:
        raise NotAllowed(f"its host {host!r} does not resolve ({e.strerror})") from None


@dataclass(frozen=True)
class RemoteMedia:
    """Which remote URLs the gateway fetches: `domains` empty, any host at public addresses
    only; else only those hosts (names as URLs write them), at any address."""

    domains: frozenset[str] = frozenset()

    def check(self, url: str) -> None:
        """Raises NotAllowed for a URL not to fetch (before any connection is made)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise NotAllowed("it is not an http(s) URL with a host")
        host = parts.hostname.lower()
        if self.domains:
            if host not in self.domains:
                raise NotAllowed(f"its host {host!r} is not one of --allowed-media-domains")
            return
        port = parts.port or (443 if parts.scheme == "https" else 80)
        for address in _addresses(host, port):
            if not _public(address):
                raise NotAllowed(f"its host {host!r} is at {address}, not a public address")

    def checked_peer(self, sock: socket.socket, host: str) -> None:
        if not self.domains and not _public(sock.getpeername()[0]):
            sock.close()
            raise NotAllowed(f"its host {host!r} was reached at a non-public address")

    def fetch(self, url: str, limit: int, timeout: float) -> bytes:
        """The first `limit` + 1 bytes of the file at `url` (more: the caller's refusal)."""
        request = urllib.request.Request(url, headers={"User-Agent": "qwen-embed-gateway"})
        try:
            with self._opener.open(request, timeout=timeout) as response:
                return response.read(limit + 1)
        except urllib.error.URLError as e:
            if isinstance(e.reason, NotAllowed):
                raise e.reason from None
            raise

    @functools.cached_property
    def _opener(self) -> urllib.request.OpenerDirector:
        """http(s) only (a redirect to another scheme is not followed), each request
        through `check` and its connection through `checked_peer`; one for every fetch (its
        handlers keep no state of a request's)."""
        opener = urllib.request.OpenerDirector()
        for handler in (
            urllib.request.ProxyHandler(),
            _HTTPHandler(self),
            _HTTPSHandler(self),
            urllib.request.HTTPDefaultErrorHandler(),
            urllib.request.HTTPRedirectHandler(),
            urllib.request.HTTPErrorProcessor(),
            urllib.request.UnknownHandler(),
        ):
            opener.add_handler(handler)
        return opener


class _Checked:
    """A connection whose peer the policy checks once connected (`direct`: not through a
    proxy, whose address it would be)."""

    def __init__(self, *args, policy: RemoteMedia, direct: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self._policy, self._direct = policy, direct

    def connect(self):
        super().connect()
        if self._direct:
            self._policy.checked_peer(self.sock, self.host)


class _CheckedHTTP(_Checked, http.client.HTTPConnection):
    pass


class _CheckedHTTPS(_Checked, http.client.HTTPSConnection):
    pass


def _direct(request: urllib.request.Request) -> bool:
    """Whether a request goes straight to its host (not through a proxy)."""
    return not request.has_proxy() and request._tunnel_host is None


class _Checking:
    """A handler whose requests go through the policy's `check`, and their connections
    (`connection`, a _Checked class) through its `checked_peer`."""

    def __init__(self, policy: RemoteMedia):
        super().__init__()
        self._policy = policy

    def _checked_open(self, connection, request, **kwargs):
        self._policy.check(request.full_url)
        return self.do_open(
            connection, request, policy=self._policy, direct=_direct(request), **kwargs
        )


class _HTTPHandler(_Checking, urllib.request.HTTPHandler):
    def http_open(self, request):
        return self._checked_open(_CheckedHTTP, request)


class _HTTPSHandler(_Checking, urllib.request.HTTPSHandler):
    def https_open(self, request):
        return self._checked_open(_CheckedHTTPS, request, context=self._context)
