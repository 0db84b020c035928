"""What the HTTP door reads of the front end, as a type.

The front end starts the HTTP listeners and the listeners' routes call back into the front end;
typing the routes against this protocol, rather than ``FrontEnd`` itself, keeps the two from
importing each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from scheduler.local import LocalConnection
    from scheduler.settings import FrontEndSettings
    from scheduler.tenants import TenantTable
    from workers.api import ModelInfo


class Front(Protocol):
    """The front end as the HTTP routes and listeners see it (``scheduler.frontend.FrontEnd``)."""

    settings: FrontEndSettings
    #: The latest ``stats()``; a metrics scrape reads it.
    published: dict[str, Any]

    @property
    def status(self) -> str: ...

    @property
    def model_info(self) -> ModelInfo | None: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def tenant_table(self) -> TenantTable: ...

    def open_local(self, tenant: str) -> LocalConnection: ...

    def stats(self, only: str | None = None) -> dict[str, Any]: ...
