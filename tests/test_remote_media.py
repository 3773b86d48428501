"""The gateway's fetches of remote images and videos (gateway/remote_media.py) against a real
web server on this host: with --allow-remote-images only hosts at public addresses are
fetched (so loopback, private, link-local and the cloud metadata address are refused, before
any connection, and a host that resolves to a public address but is reached at another is cut
off once connected); with --allowed-media-domains only those hosts, wherever they are; every
redirect is held to the same rule, and one to another scheme is not followed."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from qwen_embed_client.gateway import media, remote_media
from qwen_embed_client.gateway.errors import APIError
from qwen_embed_client.gateway.remote_media import NotAllowed, RemoteMedia

from triton_helpers import file_server

FILE = b"\x89PNG\r\n\x1a\n an image file's bytes"
TLS = Path(__file__).parent / "tls"  # a self-signed certificate for 127.0.0.1, and its key


@pytest.fixture(scope="module")
def web():
    """(port, paths asked) of a web server of FILE on this host."""
    with file_server(FILE) as served:
        yield served


@pytest.fixture(scope="module")
def tls_web():
    """The same over HTTPS, with the test certificate for 127.0.0.1."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(TLS / "cert.pem", TLS / "key.pem")
    with file_server(FILE, context) as served:
        yield served


def fetch(policy: RemoteMedia, url: str) -> bytes:
    return policy.fetch(url, 1 << 20, timeout=10)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/a.png",
        "http://localhost/a.png",
        "http://[::1]/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://169.254.169.254/latest/meta-data/",  # clouds' metadata service
        "http://10.0.0.7/a.png",
        "https://192.168.1.1/a.png",
        "http://100.64.0.1/a.png",  # carrier-grade NAT: not public either
        "http://[fd00::1]/a.png",
        "http://0.0.0.0/a.png",
        "ftp://example.com/a.png",
        "file:///etc/passwd",
    ],
)
def test_only_public_addresses_are_fetched_by_default(url):
    with pytest.raises(NotAllowed):
        RemoteMedia().check(url)  # refused before connecting: no connection is tried


def test_a_public_address_passes_the_check():
    RemoteMedia().check("http://8.8.8.8/a.png")  # the check alone: nothing is fetched
    RemoteMedia().check("https://[2001:4860:4860::8888]/a.png")


def test_a_host_on_this_host_is_refused_and_an_allowed_one_fetched(web):
    port, _ = web
    base = f"http://127.0.0.1:{port}"
    with pytest.raises(NotAllowed, match="not a public address"):
        fetch(RemoteMedia(), f"{base}/image.png")
    allowed = RemoteMedia(frozenset({"127.0.0.1"}))
    assert fetch(allowed, f"{base}/image.png") == FILE
    with pytest.raises(NotAllowed, match="not one of --allowed-media-domains"):
        fetch(allowed, f"http://localhost:{port}/image.png")


def test_every_redirect_is_held_to_the_same_rule(web):
    port, asked = web
    allowed = RemoteMedia(frozenset({"127.0.0.1"}))
    base = f"http://127.0.0.1:{port}"
    assert fetch(allowed, f"{base}/to/{base}/image.png") == FILE
    asked.clear()
    with pytest.raises(NotAllowed, match="'localhost' is not one of"):
        fetch(allowed, f"{base}/to/http://localhost:{port}/image.png")
    assert asked == [f"/to/http://localhost:{port}/image.png"]  # the redirect not followed
    with pytest.raises(OSError, match="not allowed|unknown url type"):
        fetch(allowed, f"{base}/to/ftp://127.0.0.1/image.png")


def test_a_name_that_resolves_elsewhere_the_second_time_is_cut_off(web, tls_web, monkeypatch):
    """The check before connecting sees a public address, the connection reaches this host
    (as a name whose DNS answer changes between the two would): refused once connected,
    before the request is sent, over HTTP and HTTPS."""
    monkeypatch.setenv("SSL_CERT_FILE", str(TLS / "cert.pem"))  # trusted, as a real CA's is
    tls_url = f"https://127.0.0.1:{tls_web[0]}/image.png"
    assert fetch(RemoteMedia(frozenset({"127.0.0.1"})), tls_url) == FILE
    monkeypatch.setattr(remote_media, "_addresses", lambda host, port: ["8.8.8.8"])
    for url, asked in [(f"http://127.0.0.1:{web[0]}/image.png", web[1]), (tls_url, tls_web[1])]:
        asked.clear()
        with pytest.raises(NotAllowed, match="reached at a non-public address"):
            fetch(RemoteMedia(), url)
        assert asked == [], url


def test_a_refused_url_is_a_refusal_naming_the_field(web):
    url = f"http://127.0.0.1:{web[0]}/image.png"
    for remote, words in [
        (None, "remote image URLs are not allowed here"),
        (RemoteMedia(), "image URL is not fetched here: its host '127.0.0.1' is at 127.0.0.1"),
    ]:
        with pytest.raises(APIError) as e:
            asyncio.run(media.file_bytes(url, "input[2]", "image", remote))
        assert e.value.param == "input" and words in e.value.message, e.value.message
    fetched = asyncio.run(
        media.file_bytes(url, "input[2]", "image", RemoteMedia(frozenset({"127.0.0.1"})))
    )
    assert fetched == FILE
