"""Which local user holds the other end of a loopback TCP connection (Linux).

TCP has no ``SO_PEERCRED``; Linux lists every TCP socket of the network namespace in
``/proc/net/tcp`` and ``/proc/net/tcp6`` with the uid that created it. The peer's socket is the row
whose local address is the peer's and whose remote address is ours. ``None`` whenever that cannot
be told (not Linux, another network namespace, a socket already in TIME_WAIT, whose uid reads 0):
the caller must then ask for something else, never guess.
"""

from __future__ import annotations

import ipaddress
import struct
from pathlib import Path

#: Where Linux lists TCP sockets (IPv4, IPv6); a test may point these elsewhere only by argument.
PROC_NET = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
#: The state column's value for TIME_WAIT (its uid column is always 0).
_TIME_WAIT = "06"


def _hex_address(host: str, port: int) -> tuple[str, str] | None:
    """``(hex for /proc/net/tcp, hex for /proc/net/tcp6)`` of one endpoint (``""`` where it cannot
    appear), as the kernel prints it: each 32-bit word of the address in host byte order."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        v4: ipaddress.IPv4Address | None = ip.ipv4_mapped
        v6 = ip
    elif isinstance(ip, ipaddress.IPv4Address):
        v4, v6 = ip, ipaddress.IPv6Address(f"::ffff:{ip}")
    else:
        v4, v6 = None, ip
    as4 = "" if v4 is None else f"{struct.unpack('=I', v4.packed)[0]:08X}:{port:04X}"
    as6 = "".join(f"{w:08X}" for w in struct.unpack("=4I", v6.packed)) + f":{port:04X}"
    return as4, as6


def peer_uid(peer: tuple[str, int], ours: tuple[str, int], tables: tuple[Path, Path] = PROC_NET) -> int | None:
    """The uid that owns the socket at ``peer`` connected to ``ours``, or ``None`` if unknown."""
    a, b = _hex_address(*peer), _hex_address(*ours)
    if a is None or b is None:
        return None
    for table, (local, remote) in zip(tables, ((a[0], b[0]), (a[1], b[1])), strict=True):
        if not local or not remote:
            continue
        try:
            text = table.read_text()
        except OSError:
            continue
        needle = f" {local} {remote} "
        start = text.find(needle)
        while start >= 0:
            end = text.find("\n", start)
            fields = text[start + len(needle) : end if end >= 0 else None].split()
            # st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
            if len(fields) >= 5 and fields[0] != _TIME_WAIT and fields[4].isdigit():
                return int(fields[4])
            start = text.find(needle, start + 1)
    return None


def supported() -> bool:
    """Whether this system lists its TCP sockets with their owners (Linux)."""
    return PROC_NET[0].is_file()
