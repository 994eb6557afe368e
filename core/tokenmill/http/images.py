"""The images a request sends, as bytes: data URLs always; http(s) URLs only where the operator allows them.

A server that fetches any URL a client names can be made to reach what only it can reach (cloud metadata
services, admin ports: server-side request forgery). So ``--allow-image-urls`` is off by default, and with it
every address a URL or a redirect leads to must be a public one; the body is capped and the fetch timed out.
TGI's markdown form (``![](url)`` in ``inputs``) and OpenAI's ``image_url`` parts reach the same reading.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import socket
import time
from collections.abc import Callable, Sequence
from urllib.parse import urljoin, urlsplit

import httpx

from tokenmill.config import Config
from tokenmill.http.schemas import ValidationError
from tokenmill.model.vision import ImageError, ImagePrompt, Vision, decode_image

MAX_FETCHED_BYTES = 20_000_000
"""The most bytes an image fetched from a URL may have."""
FETCH_TIMEOUT = 10.0
"""Seconds a fetch may take, from connecting to its last byte."""
MAX_REDIRECTS = 3
MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
"""TGI's form of an image in ``inputs``: ``![alt](url)``."""
DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*);base64,", re.IGNORECASE)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def image_prompt(vision: Vision | None, config: Config, text: str, urls: Sequence[str], add_special_tokens: bool,
                 truncate: int | None = None) -> tuple[list[int], ImagePrompt]:
    """The token ids of ``text`` (which names each image with ``vision``'s placeholder) with its images'
    tokens, and the images, read and decoded; each failure a :class:`ValidationError` (422). A prompt with
    images is never truncated: a cut could split an image's tokens."""
    if vision is None:
        raise ValidationError("this model takes no images (it is not a vision-language model)")
    if len(urls) > config.max_images:
        raise ValidationError(f"a request may send up to {config.max_images} images (--max-images). Given: {len(urls)}")
    try:
        decoded = [decode_image(image_bytes(url, config.allow_image_urls)) for url in urls]
        ids, images = vision.prompt(text, decoded, add_special_tokens)
    except ImageError as error:
        raise ValidationError(str(error)) from None
    if truncate is not None and truncate < len(ids):
        raise ValidationError(f"`truncate` cannot cut a prompt with images ({len(ids)} tokens; the cut could split "
                              "an image's tokens)")
    return ids, images


def placeholder(vision: Vision | None) -> str | None:
    """The text that names an image in a prompt, or None where the model takes no images."""
    return vision.placeholder if vision is not None else None


def markdown_images(text: str, vision: Vision | None) -> tuple[str, list[str]]:
    """TGI's form: ``text`` with each markdown image as ``vision``'s inline image, and their URLs in order;
    for a model that takes no images (``vision`` None), the text as it is."""
    urls: list[str] = []
    if vision is None:
        return text, urls

    def swap(match: re.Match[str]) -> str:
        urls.append(match.group(1))
        return vision.inline

    return MARKDOWN_IMAGE.sub(swap, text), urls


def is_public(address: Address) -> bool:
    """Whether ``address`` is on the public internet: not loopback, private, link-local (cloud metadata
    services), multicast, reserved or unspecified (an IPv4-mapped IPv6 address is judged as its IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def image_bytes(url: str, allow_urls: bool, allowed: Callable[[Address], bool] = is_public) -> bytes:
    """The bytes ``url`` holds: a data URL's, or (with ``allow_urls``) what an http(s) URL answers. Each
    failure is a :class:`ValidationError` (422) that says what to change."""
    shown = url if len(url) <= 80 else url[:77] + "..."
    data = DATA_URL.match(url)
    if data is not None:
        try:
            return base64.b64decode(url[data.end():], validate=True)
        except (binascii.Error, ValueError):
            raise ValidationError("an image's data URL holds no valid base64") from None
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise ValidationError(f"an image must be a data URL (data:image/...;base64,...) or an http(s) URL; "
                              f"got {shown!r}")
    if not allow_urls:
        raise ValidationError("this server reads images from data URLs only (fetching http(s) URLs is off; the "
                              "operator turns it on with --allow-image-urls)")
    return fetch(url, allowed)


def fetch(url: str, allowed: Callable[[Address], bool] = is_public) -> bytes:
    """GET ``url``, following at most :data:`MAX_REDIRECTS` redirects, every host on an ``allowed`` address,
    within :data:`FETCH_TIMEOUT` and :data:`MAX_FETCHED_BYTES`. Each request goes to the address that was
    checked (the host named in ``Host`` and TLS's SNI): a name that resolves anew to another address between
    the check and the connection (DNS rebinding) is not followed."""
    deadline = time.monotonic() + FETCH_TIMEOUT
    with httpx.Client(timeout=FETCH_TIMEOUT, follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            parts, address = urlsplit(url), _checked_address(url, allowed)
            host = f"[{address}]" if address.version == 6 else str(address)
            pinned = parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")).geturl()
            request = client.build_request("GET", pinned, headers={"Host": parts.netloc.rsplit("@", 1)[-1]},
                                           extensions={"sni_hostname": parts.hostname})
            try:
                response = client.send(request, stream=True)
                try:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code != 200:
                        raise ValidationError(f"fetching an image answered HTTP {response.status_code}")
                    return _capped_body(response, deadline)
                finally:
                    response.close()
            except httpx.HTTPError as error:
                raise ValidationError(f"fetching an image failed ({type(error).__name__}: {error})") from None
    raise ValidationError(f"fetching an image took more than {MAX_REDIRECTS} redirects")


def _checked_address(url: str, allowed: Callable[[Address], bool]) -> Address:
    """The address ``url``'s host resolves to first, once every address it resolves to is ``allowed``."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValidationError("an image URL (or a redirect) must be an http(s) URL with a host")
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                                   type=socket.SOCK_STREAM)
    except ValueError as error:  # a port that is no number
        raise ValidationError(f"an image URL is malformed ({error})") from None
    except (OSError, UnicodeError) as error:
        raise ValidationError(f"an image URL's host {parts.hostname!r} does not resolve ({error})") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for address in addresses:
        if not allowed(address):
            raise ValidationError(f"an image URL's host {parts.hostname!r} is at {address}, not a public address: "
                                  "this server fetches images from the public internet only")
    return addresses[0]


def _capped_body(response: httpx.Response, deadline: float) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_FETCHED_BYTES:
        raise ValidationError(f"a fetched image is over {MAX_FETCHED_BYTES:,} bytes")
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > MAX_FETCHED_BYTES:
            raise ValidationError(f"a fetched image is over {MAX_FETCHED_BYTES:,} bytes")
        if time.monotonic() > deadline:
            raise ValidationError(f"fetching an image took over {FETCH_TIMEOUT:g} s")
    return bytes(body)
