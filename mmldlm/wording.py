"""How a count reads in a message: `counted(1, "process")` is "1 process", `counted(2, "process")`
"2 processes", never "2 process(es)"."""

from __future__ import annotations

import string
from typing import Any


def plural(noun: str) -> str:
    """The plural of an English noun of this project's messages (process, CPU, node, shard, fix, epoch)."""
    return f"{noun}es" if noun.endswith(("s", "x", "sh")) or (noun.endswith("ch") and noun != "epoch") else f"{noun}s"


def counted(num: int, noun: str) -> str:
    """`num` and `noun`, plural unless num is 1: "1 CPU", "0 warnings", "3 fixes"."""
    return f"{num} {noun if num == 1 else plural(noun)}"


class Wording(string.Formatter):
    """str.format where a noun in place of the format type counts: "{n:process}" reads "1 process" or
    "2 processes"."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if len(format_spec) > 1 and format_spec[0].isalpha():  # a noun, not a one-letter type such as "g"
            return counted(value, format_spec)
        return super().format_field(value, format_spec)
