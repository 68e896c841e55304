"""Progress of long waits: silent when short, a tqdm bar on a terminal, log lines otherwise."""

from __future__ import annotations

import logging

from torchdata_ext import _progress
from torchdata_ext._progress import Progress

log = logging.getLogger("test_progress")


class _Ticks:
    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_terminal_gets_a_bar_and_a_closing_line(monkeypatch, caplog, capsys) -> None:
    monkeypatch.setattr(_progress, "_clock", _Ticks(1.0))
    monkeypatch.setattr(_progress, "_terminal", lambda: True)
    caplog.set_level(logging.INFO, logger="test_progress")
    with Progress("fetching", log, total=5, unit="files") as p:
        for _ in range(5):
            p.update()
    assert "fetching" in capsys.readouterr().err  # the bar, on stderr
    assert [r.getMessage() for r in caplog.records] == ["fetching: done, 5 of 5 files in 3.0 s"]


def test_no_bar_when_not_allowed_and_nothing_after_a_failure(monkeypatch, caplog, capsys):
    monkeypatch.setattr(_progress, "_clock", _Ticks(1.0))
    monkeypatch.setattr(_progress, "_terminal", lambda: True)
    caplog.set_level(logging.INFO, logger="test_progress")
    try:
        with Progress("fetching", log, bar=False, unit="files") as p:
            for _ in range(3):
                p.update()
            raise OSError("boom")
    except OSError:
        pass
    assert capsys.readouterr().err == ""
    assert [r.getMessage() for r in caplog.records] == ["fetching: 2 files after 2 s"]
