"""Progress bars: tqdm when it is installed (it is not a dependency), else a plain text bar."""

from __future__ import annotations

import sys


def progress(total: int, desc: str, enabled: bool = True):
    """A bar with ``update(n=1)``, ``set_postfix_str(s)`` and ``close()``, usable as a context manager."""
    if not enabled:
        return _Bar(total, desc, None)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Bar(total, desc, sys.stderr)
    return tqdm(total=total, desc=desc, unit="cfg", file=sys.stderr, dynamic_ncols=True)


class _Bar:
    """Prints ``desc: done/total [postfix]``: in place on a terminal, else at every tenth of the way."""

    def __init__(self, total: int, desc: str, file):
        self.total, self.desc, self.file = total, desc, file
        self.n, self.postfix, self._printed = 0, "", -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._show()

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def close(self) -> None:
        if self.file is not None and self.file.isatty() and self._printed >= 0:
            print(file=self.file, flush=True)

    def _show(self) -> None:
        if self.file is None:
            return
        line = f"{self.desc}: {self.n}/{self.total}" + (f" [{self.postfix}]" if self.postfix else "")
        if self.file.isatty():
            print(f"\r{line}", end="", file=self.file, flush=True)
            self._printed = self.n
        elif self.n == self.total or self.n * 10 // max(1, self.total) > self._printed * 10 // max(1, self.total):
            print(line, file=self.file, flush=True)
            self._printed = self.n
