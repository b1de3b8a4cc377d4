"""Every private Lightning name the project uses still exists (fails naming it after an upgrade)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from mm_lightning import lightning_compat
from mm_lightning.lightning_compat import private_api

ENTRIES = private_api()


@pytest.mark.parametrize(
    ("owner_name", "owner", "attribute"), ENTRIES, ids=[f"{o}.{a}" for o, _, a in ENTRIES]
)
def test_private_lightning_name_still_exists(owner_name: str, owner: Any, attribute: str) -> None:
    assert hasattr(owner, attribute), (
        f"Lightning no longer has {owner_name}.{attribute}, which mm_lightning/lightning_compat.py relies on:"
        " fix the function that uses it there (its comment says why it is needed) before widening the"
        " lightning pin in pyproject.toml."
    )


def test_every_private_use_is_listed() -> None:
    # Control against drift: each private name read in lightning_compat.py is checked above.
    source = open(lightning_compat.__file__).read()
    body = source[source.index("# --- FitLoop") :]
    listed = {attribute for _, _, attribute in ENTRIES}
    used = set(re.findall(r"\.(_[a-z][a-z_]+)\b", body))
    assert used <= listed, f"private names used but not checked: {sorted(used - listed)}"


def test_a_missing_name_fails_naming_it() -> None:
    # Control: the check above is not vacuous.
    with pytest.raises(AssertionError, match="FitLoop._no_such_attribute"):
        test_private_lightning_name_still_exists("FitLoop", ENTRIES[0][1], "_no_such_attribute")
