"""Adapter names, shared by the registry (which assigns them) and the decoder (which receives them)."""

from __future__ import annotations

import re

from services.common.errors import InvalidArgument

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # the whole name: fullmatch


def check_adapter_name(name: str) -> str:
    """Adapter names: 1-128 chars of [A-Za-z0-9._-], starting alphanumeric.

    Raises:
        InvalidArgument: any other name (the message quotes at most its first 64 characters).
    """
    if not ADAPTER_NAME.fullmatch(name or ""):
        shown = repr(name[:64]) + ("..." if len(name) > 64 else "")
        raise InvalidArgument(
            f"adapter name {shown} is invalid; use 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")
    return name
