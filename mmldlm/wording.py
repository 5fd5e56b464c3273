"""How a count reads in a message: `counted(1, "process")` is "1 process", `counted(2, "process")`
"2 processes", never "2 process(es)"."""

from __future__ import annotations


def plural(noun: str) -> str:
    """The plural of an English noun of this project's messages (process, CPU, node, shard, fix)."""
    return f"{noun}es" if noun.endswith(("s", "x", "ch", "sh")) else f"{noun}s"


def counted(num: int, noun: str) -> str:
    """`num` and `noun`, plural unless num is 1: "1 CPU", "0 warnings", "3 fixes"."""
    return f"{num} {noun if num == 1 else plural(noun)}"
