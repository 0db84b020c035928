"""What the client-safety tests share: another user's uid, the root-only mark, and the refusal check."""

from __future__ import annotations

import os

import pytest

from clients import Client, RequestError

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another uid needs root")


def _refused(address: str) -> RequestError:
    """Opening a client on ``address`` fails at once with ``unsafe_address``."""
    with pytest.raises(RequestError) as info:
        Client(address)
    assert info.value.code == "unsafe_address"
    return info.value
