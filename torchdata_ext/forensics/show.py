"""The batches :func:`~torchdata_ext.forensics.replay.show_batches` replayed, as text for a
terminal (:func:`format_batches`) or as a Parquet table of one row per piece and special
(:func:`write_pieces`), what ``torchdata-ext batches`` prints or writes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["format_batches", "iter_pieces", "write_pieces"]

_TEXT_CHARS = 200  # of each piece's text on a terminal


def iter_pieces(batches: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One flat dict per piece and special of ``batches``: ``step``, ``rank``, ``row``,
    ``kind`` (``"piece"``, ``"special"`` or ``"pad"``) and the entry's fields."""
    for b in batches:
        for i, row in enumerate(b["rows"]):
            for p in row["pieces"]:
                yield {"step": b["step"], "rank": b["rank"], "row": i, "kind": "piece", **p}
            for s in row["specials"]:
                yield {"step": b["step"], "rank": b["rank"], "row": i, **s}


_COLUMNS = ("step", "rank", "row", "kind", "at", "dataset", "file", "file_name", "doc", "start",
            "stop", "token", "count", "text")  # fmt: skip


def write_pieces(
    batches: Iterable[dict[str, Any]], url: str, storage_options: dict[str, Any] | None = None
) -> int:
    """Write one Parquet row per piece and special of ``batches`` to ``url`` (columns
    ``step, rank, row, kind, at, dataset, file, file_name, doc, start, stop, token, count,
    text``; a column an entry lacks is null). Returns the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchdata_ext.remote import write_bytes_atomic

    rows = list(iter_pieces(batches))
    table = pa.table({c: [r.get(c) for r in rows] for c in _COLUMNS})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_bytes_atomic(url, sink.getvalue().to_pybytes(), storage_options)
    return len(rows)


def format_batches(batches: Iterable[dict[str, Any]]) -> str:
    """The batches as lines: per step and rank a header, per row its entries in row order
    (``[at] dataset file_name#doc tokens start..stop`` for a piece, ``[at] <token> xcount``
    for a special), with a piece's text (cut) below it when decoded."""
    lines: list[str] = []
    for b in batches:
        lines.append(f"step {b['step']} rank {b['rank']} (worker {b['worker']})")
        for i, row in enumerate(b["rows"]):
            lines.append(f"  row {i}")
            entries = sorted([*row["pieces"], *row["specials"]], key=lambda e: e["at"])
            for e in entries:
                if "start" in e and "stop" in e:
                    name = e.get("file_name", f"file {e['file']}")
                    lines.append(
                        f"    [{e['at']}] {e['dataset']} {name} doc {e['doc']} "
                        f"tokens {e['start']}..{e['stop']}"
                    )
                    if "text" in e:
                        # repr: a newline shows as \n, once (it escapes what it quotes)
                        lines.append(f"      {e['text'][:_TEXT_CHARS]!r}")
                else:
                    owner = f" ({e['dataset']} doc {e['doc']})" if "doc" in e else ""
                    lines.append(f"    [{e['at']}] {e['kind']} {e['token']} x{e['count']}{owner}")
    return "\n".join(lines)
