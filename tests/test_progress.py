"""Progress of long waits: silent when short, a tqdm bar on a terminal, log lines otherwise."""

from __future__ import annotations

import logging

from torchdata_ext import progress as _progress
from torchdata_ext.progress import Progress

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


def test_prepare_reports_to_a_pipe_in_bytes_with_the_time_left(tmp_path, monkeypatch, capsys):
    """``prepare`` with stderr not a terminal (a log file, ``| tee``): log lines on stderr,
    counted in input bytes out of their known total, with the time left; none with
    ``progress=False``; a run shorter than 2 s shows only its summary line."""
    import torchdata_ext
    from torchdata_ext.testing import write_jsonl

    for k in range(4):
        write_jsonl(str(tmp_path / "in" / f"p{k}.jsonl"), [f"text {k} {j}" for j in range(50)])
    sizes = [(tmp_path / "in" / f"p{k}.jsonl").stat().st_size for k in range(4)]
    total = sum(sizes)
    monkeypatch.setattr(_progress, "_terminal", lambda: False)
    monkeypatch.setattr(_progress, "_clock", _Ticks(6.0))  # each report 6 s after the last

    torchdata_ext.prepare(str(tmp_path / "in"), str(tmp_path / "o1"), progress=None)
    lines = capsys.readouterr().err.splitlines()
    # t = 6 at the start; files end at 12, 18, 24, 30: a line at 12 (>= 2 s), then >= 10 s later
    assert lines[:3] == [
        f"prepare: part 0/1: reading inputs: {sizes[0]:,} of {total:,} B after 6 s, about "
        f"{6 * (total - sizes[0]) / sizes[0]:.0f} s left",
        f"prepare: part 0/1: reading inputs: {sum(sizes[:3]):,} of {total:,} B after 18 s, "
        f"about {18 * sizes[3] / sum(sizes[:3]):.0f} s left",
        f"prepare: part 0/1: reading inputs: done, {total:,} of {total:,} B in 30.0 s",
    ]
    assert lines[3].startswith("part 0/1: 200 documents, ")

    torchdata_ext.prepare(str(tmp_path / "in"), str(tmp_path / "o2"), progress=False)
    assert capsys.readouterr().err == ""


def test_prepare_reports_through_the_logger_the_docs_name(tmp_path, monkeypatch, caplog):
    """docs/command-line.md tells users to configure ``torchdata_ext.prepare_data.progress``;
    the lines go through that logger whatever module the code lives in."""
    import torchdata_ext
    from torchdata_ext.testing import write_jsonl

    write_jsonl(str(tmp_path / "in" / "a.jsonl"), [f"text {j}" for j in range(20)])
    monkeypatch.setattr(_progress, "_terminal", lambda: False)
    logger = logging.getLogger("torchdata_ext.prepare_data.progress")
    logger.addHandler(caplog.handler)  # the application configures that logger
    try:
        caplog.set_level(logging.INFO, logger=logger.name)
        torchdata_ext.prepare(str(tmp_path / "in"), str(tmp_path / "out"), progress=True)
    finally:
        logger.removeHandler(caplog.handler)
    names = {r.name for r in caplog.records if "part 0/1" in r.getMessage()}
    assert names == {"torchdata_ext.prepare_data.progress"}
