"""Adapter names: the whole name must fit the documented pattern."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.names import check_adapter_name


@pytest.mark.parametrize("name", ["a", "sql-lora", "v1.2_final", "A" * 128])
def test_names_of_the_pattern_are_accepted(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("name", ["", "good\n", "good\nbad", "-lead", ".hidden", "a/b", "a b", "A" * 129, "é"])
def test_anything_else_is_refused(name):
    """A trailing newline was accepted (a `$` anchor matches before it), and listed as a new adapter."""
    with pytest.raises(InvalidArgument, match="is invalid"):
        check_adapter_name(name)
