"""Recording the kernel problems a run launches, for ``python -m tile_ops precompile --record``.

With ``TILE_OPS_RECORD=path`` set (or inside ``recording()``), each op call appends its kernel problem (its
``OpSpec.problem``: sizes, layouts and dtypes, what the op's kernel choice reads) to ``path`` as a JSON line,
once per distinct problem and process.  A CPU run records what the CUDA path would launch (the layout of
the call is the same on both), so a model traced on a machine without a GPU gives the list too.
"""

from __future__ import annotations

import contextlib
import json
import os

ENV = "TILE_OPS_RECORD"

_seen: set = set()  # (file, line) this process has written
_sinks: list = []  # the open recording() contexts' lists


def active() -> bool:
    return bool(_sinks) or bool(os.environ.get(ENV))


def note(spec, args) -> None:
    """Record ``spec``'s kernel problems for a call on ``args`` (none where the call launches no kernel).  A
    call the op will refuse records nothing: its own error follows."""
    if spec.problem is None:
        return
    try:
        problems = spec.problem(*args)
    except (ValueError, TypeError, KeyError, RuntimeError):
        return
    for problem in problems:
        add(spec.name, problem)


def add(op: str, problem: dict) -> None:
    """Record one kernel problem of op ``op`` (a JSON-able dict its precompile job reads back)."""
    _append({"op": op, "problem": problem})


def _append(entry: dict) -> None:
    for sink in _sinks:
        if entry not in sink:
            sink.append(entry)
    line = json.dumps(entry, sort_keys=True)
    path = os.environ.get(ENV)
    if path and (path, line) not in _seen:
        _seen.add((path, line))
        with open(path, "a") as f:  # one write of one line, appended: whole lines from concurrent processes
            f.write(line + "\n")


@contextlib.contextmanager
def recording():
    """``with recording() as problems:`` collects the problems of the op calls inside (a list of {"op",
    "problem"} dicts, distinct), besides any ``TILE_OPS_RECORD`` file."""
    sink: list = []
    _sinks.append(sink)
    try:
        yield sink
    finally:
        _sinks.remove(sink)


def read(path: str) -> list:
    """The distinct entries of a ``TILE_OPS_RECORD`` file, in order; a malformed line is a ValueError naming it."""
    entries = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                ok = isinstance(entry, dict) and isinstance(entry.get("op"), str) and isinstance(entry.get("problem"),
                                                                                                dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise ValueError(f"{path}:{n}: not a {ENV} line (a JSON object with 'op' and 'problem'): "
                                 f"{line.strip()[:80]!r}")
            if entry not in entries:
                entries.append(entry)
    return entries
