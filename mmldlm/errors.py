"""The errors a user can fix. `mmldlm CMD` prints one of them as a single line `mmldlm CMD: message`
and exits 2; `mmldlm --debug CMD` (or MMLDLM_DEBUG=1) shows the traceback too. Any other exception
is a bug and keeps its traceback. Free of heavy imports, so that the CLI can catch these without
importing torch."""

from __future__ import annotations

from typing import Any


class UserError(ValueError):
    """Input that cannot be used; the message names the file, key or option at fault, the value
    and what was expected."""


class OptionError(UserError):
    """One option with a value that cannot be used: a config key, a command-line option or a
    threshold. Every such message has one shape: `<key>: got <value>; expected <what is allowed>`."""

    def __init__(self, key: str, value: Any, expected: str):
        super().__init__(f"{key}: got {value!r}; expected {expected}")
        self.key, self.value, self.expected = key, value, expected


def require_positive(options: dict[str, int | None]) -> None:
    """OptionError for the first of `options` (name -> value; None: not given) that is below 1."""
    for key, value in options.items():
        if value is not None and value < 1:
            raise OptionError(key, value, "an integer >= 1")
