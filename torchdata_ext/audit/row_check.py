"""What every packed row must look like, rescaled or not: a check of delivered rows.

Rows are checked from their provenance tables alone (:mod:`torchdata_ext.provenance`), so it
runs on any delivered stream: a test's, the kill campaign's logs, or a user's own trace. What
an uninterrupted run guarantees, and so every rescaled one must:

* two neighbouring document tokens in a row are consecutive tokens of one document, or have
  the configured EOS or BOS between them (documents are never glued);
* in ``concat`` and ``pad`` rows, a piece that does not end its document ends its row, or is
  followed in the row by its own continuation;
* a piece starting at token 0 follows its own BOS, or starts the row (the BOS ended the row
  before), or follows an EOS (its BOS ended a row delivered before a rescale); a piece ending
  its document is followed by its own EOS, or ends the row;
* ``chunk`` rows hold one document; ``best_fit`` bins place units side by side as that mode
  documents (a head without its EOS, pieces of one document in any order), so only the counts
  below are checked for it;
* each document gets exactly one packer-placed BOS and one EOS per epoch (the specials name
  their document; ``chunk`` mode never emits a lone EOS, as it documents), and its tokens are
  delivered exactly once;
* with ``ordered`` (no shuffle buffer, one stream per worker), a document's pieces come in
  order within each stream;
* (:func:`boundary_problems`) a row's document boundaries (``seq_lens``) tile its inputs and
  cut exactly where its provenance pieces say: between two documents, around each line
  special and the padding, between two pieces of one document that are not contiguous, and
  nowhere else (a BOS and an EOS stay with their own document's piece);
* with ``budget``: what is delivered of each document is a prefix of it, and a piece that
  does not end its document may be followed by other documents in its row (a budget's cut
  ends a phase mid-document; after a rescale the rest may come from another worker) (a budget cuts a
  document's end, never its start).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchdata_ext.provenance import LITERAL, PAD, literal_owner

__all__ = ["RowRules", "boundary_problems", "row_problems"]

Key = tuple[str, int, int]  # (dataset, file, doc)


@dataclass(frozen=True)
class RowRules:
    """The packing settings the rows were made with.

    Attributes:
        bos_token: the BOS the packer places (None: none).
        eos_token: the EOS the packer places (None: none).
        mode: the pack mode (``concat``, ``pad``, ``best_fit``, ``chunk``).
        capacity: tokens of a row between the line specials (``seq_len`` (+1 with ``shift``)
            minus ``bol``/``eol``): ``chunk`` mode's lone-EOS rule needs it.
        line_tokens: the line specials (``bol``/``eol``) to pass over.
    """

    bos_token: int | None
    eos_token: int | None
    mode: str = "concat"
    capacity: int = 0
    line_tokens: frozenset[int] = frozenset()

    @classmethod
    def of(cls, cfg: Any) -> RowRules:
        """The rules of a :class:`~torchdata_ext.pipeline.config.PipelineConfig`."""
        cap = cfg.seq_length + int(cfg.shift) - (cfg.bol_token is not None)
        cap -= cfg.eol_token is not None
        return cls(
            cfg.bos_token,
            cfg.eos_token,
            cfg.pack_mode,
            cap,
            frozenset({cfg.bol_token, cfg.eol_token} - {None}),
        )


def row_problems(
    streams: Sequence[Sequence[tuple[np.ndarray, Sequence[str]]]],
    lengths: dict[Key, int],
    rules: RowRules,
    *,
    ordered: bool = False,
    budget: bool = False,
    limit: int = 20,
) -> list[str]:
    """The row invariants the ``streams`` break (empty: none), at most ``limit`` of them.

    Args:
        streams: per stream, its rows in delivery order, each as ``(provenance, names)``: the
            row's provenance table and the dataset names its dataset ids index.
        lengths: tokens of every document of the epoch, ``(dataset, file, doc) -> n``; with
            ``budget``, documents never reached may be missing from the streams.
        rules: the packing settings.
        ordered: check that each document's pieces come in order within a stream.
        budget: documents may be cut by a budget (a prefix of each delivered).
    """
    bos, eos = rules.bos_token, rules.eos_token
    sep_bos = bos if bos is not None and bos != eos else None
    mode = rules.mode
    out: list[str] = []
    ends = dict(lengths)
    if budget:  # a budget's cut document ends where the cut is (as in an uninterrupted run)
        ends = {}
        for stream in streams:
            for prov, names in stream:
                for ds, f, d, start, n in np.asarray(prov).tolist():
                    if ds >= 0:
                        k = (names[ds], f, d)
                        ends[k] = max(ends.get(k, 0), start + n)
    n_bos: dict[Key, int] = {}
    n_eos: dict[Key, int] = {}
    cover: dict[Key, list[tuple[int, int]]] = {}
    for s, stream in enumerate(streams):
        last_at: dict[Key, int] = {}
        for r, (prov, names) in enumerate(stream):
            where = f"stream {s} row {r}"
            content: list[tuple[Any, ...]] = []
            for row in np.asarray(prov).tolist():
                ds, tok, doc, start, n = row
                owner = literal_owner(row)
                if (
                    ds == PAD
                    or n == 0
                    or (ds == LITERAL and owner is None and tok in rules.line_tokens)
                ):
                    continue
                if ds == LITERAL:
                    if owner is None:
                        out.append(f"{where}: special {tok} names no document")
                        continue
                    key = (names[owner[0]], owner[1], owner[2])
                    if tok == sep_bos:
                        n_bos[key] = n_bos.get(key, 0) + 1
                        content.append(("B", key))
                    else:
                        n_eos[key] = n_eos.get(key, 0) + 1
                        content.append(("E", key))
                    continue
                key = (names[ds], tok, doc)
                cover.setdefault(key, []).append((start, start + n))
                content.append(("D", key, start, start + n))
                if ordered and mode != "best_fit":
                    if last_at.get(key, -1) > start:
                        out.append(f"{where}: {key} piece {start} comes after a later piece")
                    last_at[key] = start + n
            out.extend(_row_problems(where, content, ends, lengths, rules, sep_bos, budget))
            if len(out) >= limit:
                return out[:limit]
    out.extend(_count_problems(cover, lengths, n_bos, n_eos, rules, sep_bos, budget))
    return out[:limit]


def _row_problems(
    where: str,
    content: list[tuple[Any, ...]],
    ends: dict[Key, int],
    lengths: dict[Key, int],
    rules: RowRules,
    sep_bos: int | None,
    budget: bool,
) -> list[str]:
    """The invariants one row's content (``("B"|"E", key)`` and ``("D", key, a, b)``)
    breaks."""
    mode, eos = rules.mode, rules.eos_token
    out = []
    if mode == "chunk" and len({c[1] for c in content}) > 1:
        out.append(f"{where}: a chunk row holds {sorted({c[1] for c in content})}")
    if mode == "best_fit":  # bins mix units (documented)
        return out
    separated = sep_bos is not None or eos is not None
    for i, c in enumerate(content):
        if c[0] != "D":
            continue
        _, key, a, b = c
        prev = content[i - 1] if i else None
        nxt = content[i + 1] if i + 1 < len(content) else None
        contiguous = prev is not None and prev[1] == key and prev[-1] == a
        if prev is not None and prev[0] == "D" and separated and not contiguous:
            out.append(f"{where}: {prev[1]}[..{prev[3]}] glued to {key}[{a}..]")
        own_bos = prev is not None and prev[0] == "B" and prev[1] == key
        if a == 0 and sep_bos is not None and prev is not None and not own_bos and prev[0] != "E":
            out.append(f"{where}: {key} starts after {prev}, not after its BOS")
        goes_on = nxt is not None and nxt[0] == "D" and nxt[1] == key and nxt[2] == b
        ends_here = b == ends[key] or budget
        if not ends_here and nxt is not None and mode in ("concat", "pad") and not goes_on:
            out.append(f"{where}: {key}[{a}..{b}] of {ends[key]} does not end its row")
        own_eos = nxt is not None and nxt[0] == "E" and nxt[1] == key
        if b == lengths[key] and eos is not None and nxt is not None and not own_eos:
            out.append(f"{where}: {key} ends, followed by {nxt}, not its EOS")
    return out


def _count_problems(
    cover: dict[Key, list[tuple[int, int]]],
    lengths: dict[Key, int],
    n_bos: dict[Key, int],
    n_eos: dict[Key, int],
    rules: RowRules,
    sep_bos: int | None,
    budget: bool,
) -> list[str]:
    """Tokens exactly once (a prefix with ``budget``), BOS and EOS once per document."""
    out = []
    for key, ranges in cover.items():
        ranges.sort()
        pos = 0
        for a, b in ranges:
            if a != pos:
                out.append(f"{key}: tokens {pos}..{a} missing or repeated ({ranges[:6]})")
                break
            pos = b
        else:
            if not budget and pos != lengths.get(key):
                out.append(f"{key}: delivered {pos} of {lengths.get(key)} tokens")
    if not budget:
        missing = [k for k, n in lengths.items() if n and k not in cover]
        if missing:
            out.append(f"{len(missing)} documents never delivered, e.g. {missing[:3]}")
    started = {k for k, r in cover.items() if r and r[0][0] == 0}
    if sep_bos is not None:
        wrong = {k: n_bos.get(k, 0) for k in started | set(n_bos) if n_bos.get(k, 0) != 1}
        if wrong:
            out.append(f"{len(wrong)} documents without exactly one BOS, e.g. {_some(wrong)}")
    if rules.eos_token is not None:
        ended = {k for k, r in cover.items() if r and r[-1][1] == lengths.get(k)}
        want = dict.fromkeys(ended, 1)
        if rules.mode == "chunk":  # a lone EOS is never emitted in chunk mode (its docstring)
            head = int(sep_bos is not None)
            want = {k: int((lengths[k] + head) % rules.capacity != 0) for k in ended}
        wrong = {k: n_eos.get(k, 0) for k in ended | set(n_eos) if n_eos.get(k, 0) != want.get(k)}
        if wrong:
            out.append(f"{len(wrong)} documents without exactly one EOS, e.g. {_some(wrong)}")
    return out


def _some(d: dict[Key, int]) -> dict[Key, int]:
    return dict(sorted(d.items())[:5])


def boundary_problems(
    where: str, prov: np.ndarray, names: Sequence[str], seq_lens: np.ndarray, width: int
) -> list[str]:
    """How one row's boundaries ``seq_lens`` (the ``seq_lens`` output key of the row: segment
    lengths, then zeros) disagree with its provenance table ``prov`` (empty: they agree).

    Args:
        where: names the row in the messages.
        prov: the row's ``(k, 5)`` provenance table (rows of length 0 are skipped).
        names: the dataset names its dataset ids index.
        seq_lens: the row's segment lengths.
        width: the row's input tokens (``seq_len``; the provenance covers one more with
            ``shift``).
    """
    lens = [int(n) for n in np.asarray(seq_lens).tolist()]
    used = lens[: next((i for i, n in enumerate(lens) if n == 0), len(lens))]
    if sum(used) != width or any(lens[len(used) :]):
        return [f"{where}: seq_lens {lens} do not tile the row's {width} tokens, then zeros"]
    starts = set(np.cumsum([0, *used[:-1]]).tolist())
    # each input token: (unit, key, kind, offset): unit tells line specials and the padding
    # row apart; key is the document a content token belongs to (a BOS/EOS: its owner)
    toks: list[tuple[int, Any, str, int]] = []
    for u, row in enumerate(np.asarray(prov).tolist()):
        ds, tok, doc, start, n = row
        if n == 0:
            continue
        owner = literal_owner(row)
        if ds >= 0:
            toks.extend((-1, (names[ds], tok, doc), "D", start + i) for i in range(n))
        elif owner is not None:
            kind = "E" if toks and toks[-1][1] == (names[owner[0]], *owner[1:]) else "B"
            toks.append((-1, (names[owner[0]], owner[1], owner[2]), kind, 0))
        else:  # a line special or the padding: a segment of its own
            toks.extend((u, None, "L", 0) for _ in range(n))
    if len(toks) < width:
        return [f"{where}: the provenance covers {len(toks)} tokens, not the row's {width}"]
    out = []
    for t in range(1, width):
        (pu, pk, pkind, pa), (cu, ck, ckind, ca) = toks[t - 1], toks[t]
        if pkind == "L" or ckind == "L":
            cut = pu != cu or pkind != ckind
        elif pk != ck:
            cut = True
        elif pkind == "D" and ckind == "D":
            cut = ca != pa + 1
        elif ckind == "B":
            cut = True
        else:  # a BOS before its document, an EOS after it
            cut = False
        if cut != (t in starts):
            what = "a cut" if cut else "no cut"
            out.append(f"{where}: token {t} ({toks[t - 1]} | {toks[t]}) needs {what}, {lens}")
    return out
