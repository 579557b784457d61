"""The addresses a dashboard is reached at: from this machine, and from elsewhere.

On a wildcard bind (``--host 0.0.0.0``) the first link printed used to be ``http://127.0.0.1:PORT/``
(which answers 401 there, since a network bind needs the token) and the token link named
``localhost`` (``socket.getfqdn()`` on a machine whose hosts file maps its name to 127.0.1.1): neither
opens from another machine. The links others use are the machine's host name and its non-loopback
interface addresses (psutil), or the address the user bound to.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

WILDCARDS = ("0.0.0.0", "::", "")


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def local_url(host: str, port: int) -> str:
    """Where clients on this machine reach a server bound to ``host``."""
    return url("127.0.0.1" if host in WILDCARDS else host, port)


def public_urls(host: str, port: int) -> list[str]:
    """Where a person on another machine opens it: the address bound to, or for a wildcard bind
    the machine's name and each non-loopback address it has (IPv6 too for ``::``)."""
    if host not in WILDCARDS:
        return [url(host, port)]
    names = [name] if (name := socket.gethostname()) and not _loopback_name(name) else []
    families = (socket.AF_INET, socket.AF_INET6) if host == "::" else (socket.AF_INET,)
    try:
        interfaces = psutil.net_if_addrs()
    except OSError:
        interfaces = {}
    for addresses in interfaces.values():
        for address in addresses:
            if address.family in families and _reachable(address.address.split("%")[0]):
                names.append(address.address.split("%")[0])
    return [url(name, port) for name in dict.fromkeys(names)] or [local_url(host, port)]


def _loopback_name(name: str) -> bool:
    return name.lower().startswith("localhost") or _is_ip(name) and not _reachable(name)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _reachable(text: str) -> bool:
    """An address another machine may reach: not loopback, link-local or unspecified."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)
