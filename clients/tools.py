"""Tools on the wire: a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked and
held as ``Tools``, the one check the native protocol and the daemon's HTTP doors share.

``tools`` is OpenAI's list of function tools (``{"type": "function", "function": {"name",
"description", "parameters"}}``); ``tool_choice`` is ``"auto"``, ``"none"``, ``"required"`` or
``{"type": "function", "function": {"name": ...}}``. A refusal is a ``ToolError``: a
``ProtocolError`` (``bad_field``) that also names the request field to fix (``param``), so an HTTP
door can answer it in its own shape. Pure data: no MLX, no ZeroMQ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from clients.wire import ErrorCode, ProtocolError

#: OpenAI's rule for a function's name.
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
#: Characters of a client's value that an error message quotes.
_SHOWN = 40
#: The most tools one request may define.
MAX_TOOLS = 128  # OpenAI's bound


class ToolError(ProtocolError):
    """A refused tool field: ``code`` and ``message`` as any ``ProtocolError``, plus ``param``, the
    request field it is about (``tools``, ``tool_choice``, ``parallel_tool_calls``)."""

    def __init__(
        self, message: str, param: str, request_id: str | None = None, code: ErrorCode = ErrorCode.BAD_FIELD
    ) -> None:
        super().__init__(code, message, request_id)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's tools, as the chat template takes them, and how the answer treats calls."""

    tools: list[dict[str, Any]]
    #: ``tool_choice`` ``auto``: calls in the answer are parsed into ``tool_calls``; ``none``: the
    #: answer is text.
    parse: bool = True
    #: ``parallel_tool_calls`` false: the answer keeps its first call only.
    parallel: bool = True
    #: ``tool_choice`` ``required`` or a named function: the answer must be calls (the grammar
    #: engine enforces it).
    forced: bool = False
    #: The function a named ``tool_choice`` names (``None``: any of ``tools``).
    name: str | None = None

    @property
    def forced_shown(self) -> str:
        """The forced choice as an error message names it."""
        return f"naming {self.name[:_SHOWN]!r}" if self.name is not None else "requiring a call"

    @property
    def choice(self) -> str | dict[str, Any]:
        """``tool_choice`` as the wire writes it (the inverse of ``parse_tools``)."""
        if self.name is not None:
            return {"type": "function", "function": {"name": self.name}}
        if self.forced:
            return "required"
        return "auto" if self.parse else "none"


def check_function(fn: Any, where: str, param: str, rid: str | None = None) -> dict[str, Any]:
    """One function definition: a valid ``name``, an optional ``description`` and JSON-schema
    ``parameters`` object; returned with the description and parameters filled in."""
    if not isinstance(fn, dict):
        raise ToolError(f"{where} must be an object", param, rid)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.name is required: a non-empty string", param, rid)
    if not _NAME.match(name):
        raise ToolError(
            f"{where}.name {name[:_SHOWN]!r} must be 1 to 64 letters, digits, '_', '.', ':' or '-'", param, rid
        )
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ToolError(f"{where}.description must be a string", param, rid)
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ToolError(f"{where}.parameters must be a JSON schema object", param, rid)
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ToolError(f"{where}.strict must be a boolean", param, rid)
    return {"name": name, "description": fn.get("description") or "", "parameters": params or {}}


def parse_tools(tools: Any, choice: Any, parallel: Any, rid: str | None = None) -> Tools | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as one ``Tools``; ``None`` without
    tools. Raises ``ToolError`` naming the field to fix."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", rid)
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' names a tool but 'tools' is empty", "tool_choice", rid)
        return None
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of function tools", "tools", rid)
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' holds at most {MAX_TOOLS} tools", "tools", rid)
    defs: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"{where} must be an object with type 'function'", "tools", rid)
        defs.append(
            {"type": "function", "function": check_function(tool.get("function"), f"{where}.function", "tools", rid)}
        )
    names: set[str] = set()
    for d in defs:
        if d["function"]["name"] in names:
            raise ToolError(f"'tools' defines the function {d['function']['name']!r} twice", "tools", rid)
        names.add(d["function"]["name"])
    if choice in (None, "auto", "none"):
        return Tools(defs, parse=choice != "none", parallel=parallel is not False)
    if choice == "required":
        return Tools(defs, parallel=parallel is not False, forced=True)
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ToolError("'tool_choice.function.name' is required: a non-empty string", "tool_choice", rid)
        if name not in names:
            raise ToolError(
                f"'tool_choice' names the function {name[:_SHOWN]!r}, which 'tools' does not define", "tool_choice", rid
            )
        return Tools(defs, parallel=False, forced=True, name=name)
    raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', ...}", "tool_choice", rid)
