"""Encode a long document in pieces, with exactly the ids of encoding it whole.

Why: the fast tokenizer holds ~450 bytes a token while it encodes (token strings, offsets, the
normalized text's alignments), so one 4.4 MB document held ~600 MB in the worker encoding it,
most of a 1 GB host. In pieces of ``SPLIT_CHARS`` characters it holds what one piece needs.

Why the ids do not change: ``tokenizers`` encodes a text as added-token extraction, normalizer,
pre-tokenizer, then the model on each pre-token alone (BPE, WordPiece, Unigram and WordLevel
never look across a pre-token), then the post-processor. The ids are the model's ids of the
pre-tokens one after another, so cutting the text at ``e`` changes none exactly when the
pre-tokens of the text are those of ``text[:e]`` followed by those of ``text[e:]``. A candidate
``e`` (after or before a newline, else before a space, about ``SPLIT_CHARS`` after the previous
cut; those with no other whitespace beside them first) is proven on windows of ``context``
characters around it, normalized and pre-tokenized as the tokenizer does, offsets read in the
original text:

- ``e`` is a pre-token boundary of ``text[e-C:e+C]``, whose pre-token strings are those of
  ``text[e-C:e]`` followed by those of ``text[e:e+C]`` (two at least): this catches what acts on a
  whole text (a ``Prepend``/``Strip`` normalizer, Metaspace's or ByteLevel's prefix on a text's
  start, ``^``, look-behind) and what differs at a text's end;
- the window is in step with the whole document's pre-tokenization: started ``C`` characters
  earlier, the pre-tokens from ``e - C/2`` on are the same, with a boundary before ``e`` (a
  window that starts at the text's start needs no such check);
- where an added token's text is near (they are taken out before normalizing, and some take the
  whitespace beside them), the same checks run on the whole pipeline's ids instead.

A check costs ~7 contexts of pre-tokenizing, against a piece's whole encoding (pre-tokenizing a
text costs about what encoding it does, so proofs over whole pieces would double the work). What
the windows assume is locality: the pre-tokenizer's decision at ``e`` depends on characters within
``C`` of it. HF's pre-tokenizers and normalizers are local; the Split regexes accepted look ahead
one character at most (``\\s+(?!\\S)``), one with any other look-ahead is not cut. A tokenizer whose
pipeline cannot be cut (no pre-tokenizer, a ``Prepend``/``Strip`` normalizer, Metaspace or ByteLevel
pre-tokenizing the whole text as one piece, BPE dropout) or a document where no cut proves safe is
encoded whole, said once per process. With special tokens, the post-processor's ids go around
the pieces' ids as it puts them around one sequence's.
"""
from __future__ import annotations

import bisect
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

SPLIT_CHARS = 1 << 17
"""A document longer than this many characters is encoded in pieces of about this size (~15 MB
of the tokenizer's memory each, like one ``BATCH_BYTES`` batch)."""
CONTEXT_CHARS = 1024
"""Characters past a cut that its proof pre-tokenizes."""
TRIES = 16
"""Candidate cuts that fail their proof (each pre-tokenizes ~7 contexts) before a range is given up."""

_LOOKAHEAD = re.compile(r"\(\?(?:=|!(?!\\S\)))")
_WHOLE_TEXT_NORMALIZERS = {"Prepend", "Strip"}
_SPECIAL_ADDERS = {"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel"}


def _walk(node: Any, key: str) -> Iterator[dict]:
    """A normalizer's or pre-tokenizer's config and those inside its ``Sequence``."""
    if isinstance(node, dict):
        yield node
        for child in node.get(key) or []:
            yield from _walk(child, key)


def unsplittable(tok: Any) -> str | None:
    """Why ``tok`` (a ``tokenizers.Tokenizer``) cannot be cut anywhere, or None when cuts can be proven."""
    cfg = json.loads(tok.to_str())
    model = cfg.get("model") or {}
    if model.get("type") == "BPE" and model.get("dropout"):
        return "its BPE has dropout (the ids are random)"
    norms = {n.get("type") for n in _walk(cfg.get("normalizer"), "normalizers")}
    if norms & _WHOLE_TEXT_NORMALIZERS:
        return f"its normalizer {sorted(norms & _WHOLE_TEXT_NORMALIZERS)[0]} acts on the whole text"
    pres = list(_walk(cfg.get("pre_tokenizer"), "pretokenizers"))
    if not pres:
        return "it has no pre-tokenizer (the whole document is one pre-token)"
    cutters = [p for p in pres if p.get("type") != "Sequence" and not (
        p.get("type") == "Metaspace" and p.get("split") is False) and not (
        p.get("type") == "ByteLevel" and p.get("use_regex") is False)]
    if not cutters:
        return f"its pre-tokenizer ({', '.join(str(p.get('type')) for p in pres)}) keeps the whole text as one pre-token"
    for p in pres:
        pattern = (p.get("pattern") or {}).get("Regex") if p.get("type") == "Split" else None
        if pattern and _LOOKAHEAD.search(pattern):
            return "its Split regex looks ahead further than one character"
    return None


@dataclass
class DocSplitter:
    """Encodes texts with ``tok`` (a ``tokenizers.Tokenizer``), each one longer than ``bound``
    characters in proven pieces (see the module's docstring); picklable for ``datasets`` workers."""

    tok: Any
    bound: int = field(default_factory=lambda: SPLIT_CHARS)
    context: int = field(default_factory=lambda: CONTEXT_CHARS)
    reason: str | None = field(default=None, init=False)
    """Why this tokenizer is never cut (None: cuts are proven per document)."""
    pieces: int = field(default=0, init=False)
    """Pieces encoded so far (for tests and reports)."""
    _said: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.reason = unsplittable(self.tok)
        if self.tok.truncation or self.tok.padding:
            self.reason = "its truncation or padding is on (call no_truncation/no_padding as HF's __call__ does)"
        tokens = self.tok.get_added_tokens_decoder().values()
        self._added = _any_of(t.content for t in tokens)
        self._added_normalized = _any_of(t.content for t in tokens if t.normalized) if self.tok.normalizer else None

    def ids_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids without special tokens (uint32), as ``tok.encode_batch`` gives them."""
        out: list[np.ndarray | None] = [None] * len(texts)
        short = [i for i, t in enumerate(texts) if len(t) <= self.bound]
        for i, enc in zip(short, self.tok.encode_batch([texts[i] for i in short], add_special_tokens=False)):
            out[i] = np.asarray(enc.ids, dtype=np.uint32)
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self.ids(t)
        return out  # type: ignore[return-value]

    def ids(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """``tok.encode(text, add_special_tokens).ids`` (uint32), holding one piece's memory at a time."""
        cuts = list(self.cuts(text))
        if len(cuts) <= 2 or (add_special_tokens and self._specials() is None):
            return np.asarray(self.tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.uint32)
        parts = [np.asarray(self.tok.encode(text[a:b], add_special_tokens=False).ids, dtype=np.uint32)
                 for a, b in zip(cuts, cuts[1:])]
        self.pieces += len(parts)
        if add_special_tokens:
            pre, post = self._specials()  # type: ignore[misc]
            parts = [np.asarray(pre, dtype=np.uint32), *parts, np.asarray(post, dtype=np.uint32)]
        return np.concatenate(parts)

    def cuts(self, text: str, final: bool = True) -> Iterator[int]:
        """0, the proven cuts, ``len(text)``; a text that is not ``final`` (its document goes on past
        it) ends at its last cut, with at most ``bound`` characters after it, and none within
        ``context`` of its end."""
        yield 0
        s, n = 0, len(text)
        if n > self.bound and self.reason is not None:
            self._say(f"a document of {n:,} characters is encoded whole: {self.reason}")
            s = n
        while n - s > self.bound:
            e = self._cut(text, s, final)
            if e is None:
                if final:
                    self._say(f"a document of {n:,} characters is encoded whole from character {s:,}: no cut in "
                              f"the next {4 * self.bound:,} characters proves safe")
                break
            yield e
            s = e
        if final:
            yield n

    def _cut(self, text: str, s: int, final: bool = True) -> int | None:
        """The first proven cut in ``(s + bound/2, s + bound]`` (from the right), else further on."""
        n, C = len(text), self.context
        last = n - 1 if final else n - C
        for k, (lo, hi) in enumerate(((s + self.bound // 2, s + self.bound), (s + self.bound, s + 2 * self.bound),
                                      (s + 2 * self.bound, s + 4 * self.bound))):
            hi = min(hi, last)
            tries = 0
            for r_lo, r_hi in _regions(lo, hi, 4 * C, reverse=k == 0):
                candidates = list(_candidates(text, r_lo, r_hi, reverse=k == 0))
                if not candidates:
                    continue
                a, b = max(0, r_lo - C), min(n, r_hi + C)
                units = self._units(text, a, b, self._holds_added(text[a:b]))  # which candidates are boundaries
                starts = [x for _, (x, _) in units]
                for e in candidates:
                    if _boundary(units, starts, e) is None:
                        continue
                    if self._proves(text, e):
                        return e
                    tries += 1
                    if tries >= TRIES:
                        break
                if tries >= TRIES:
                    break
            if hi >= last:
                break
        return None

    def _proves(self, text: str, e: int) -> bool:
        """Whether cutting ``text`` at ``e`` keeps its ids (the checks of the module's docstring)."""
        C = self.context
        a, b = max(0, e - C), min(len(text), e + C)
        ids = self._holds_added(text[max(0, e - 2 * C):b])
        units = self._units(text, a, b, ids)
        i = _boundary(units, [x for _, (x, _) in units], e)
        if i is None:
            return False
        right = self._units(text, e, b, ids)
        if len(right) < 2 or [u for u, _ in right] != [u for u, _ in units[i:]]:
            return False
        if [u for u, _ in self._units(text, a, e, ids)] != [u for u, _ in units[:i]]:
            return False
        if a == 0:
            return True  # the window starts where the text does
        near = [t for t in units if t[1][0] >= e - C // 2]
        wider = [t for t in self._units(text, max(0, e - 2 * C), b, ids) if t[1][0] >= e - C // 2]
        return near == wider and any(x < e for _, (x, _) in near)

    def _units(self, text: str, a: int, b: int, ids: bool) -> list[tuple[Any, tuple[int, int]]]:
        """``text[a:b]``'s pre-tokens (strings), or with ``ids`` (an added token's text is near) the
        whole pipeline's ids; with their offsets in ``text``'s characters."""
        window = text[a:b]
        if ids:
            enc = self.tok.encode(window, add_special_tokens=False)
            return [(t, (a + x, a + y)) for t, (x, y) in zip(enc.ids, enc.offsets)]
        from tokenizers import PreTokenizedString

        pts = PreTokenizedString(window)
        if self.tok.normalizer is not None:
            pts.normalize(self.tok.normalizer.normalize)
        self.tok.pre_tokenizer.pre_tokenize(pts)
        return [(p, (a + x, a + y)) for p, (x, y), _ in pts.get_splits(offset_referential="original",
                                                                     offset_type="char")]

    def _holds_added(self, window: str) -> bool:
        """Whether an added token's text occurs in ``window`` (raw, or normalized for normalized tokens)."""
        if self._added is not None and self._added.search(window):
            return True
        return self._added_normalized is not None and bool(
            self._added_normalized.search(self.tok.normalizer.normalize_str(window)))

    def _specials(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts before and after one sequence, when that is all it does."""
        cfg = json.loads(self.tok.to_str()).get("post_processor")
        kinds = {p.get("type") for p in _walk(cfg, "processors")} - {"Sequence"}
        if not kinds <= _SPECIAL_ADDERS:
            return None
        probe = "a"
        plain = self.tok.encode(probe, add_special_tokens=False).ids
        full = self.tok.encode(probe, add_special_tokens=True).ids
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return full[:i], full[i + len(plain):]
        return None

    def _say(self, line: str) -> None:
        if not self._said:
            self._said = True
            warnings.warn(line, stacklevel=3)


def _any_of(words: Iterator[str]) -> re.Pattern | None:
    """A regex matching any of ``words`` (None for none)."""
    words = sorted({w for w in words if w}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, words))) if words else None


def _candidates(text: str, lo: int, hi: int, reverse: bool) -> Iterator[int]:
    """Cut positions in ``[lo, hi]``: after and before each newline, then before each space; first
    those with no other whitespace beside them (where most pre-tokenizers cut), then the rest."""
    def at(ch: str) -> Iterator[int]:
        pos = text.rfind(ch, lo, hi + 1) if reverse else text.find(ch, lo, hi + 1)
        while pos >= 0:
            yield pos
            pos = text.rfind(ch, lo, pos) if reverse else text.find(ch, pos + 1, hi + 1)

    def clean(e: int) -> bool:
        return not text[e - 1:e].isspace() or not text[e:e + 1].isspace() or text[e - 1:e + 1] == "\n "

    for pick in (clean, lambda e: not clean(e)):
        for pos in at("\n"):
            for e in (pos + 1, pos):
                if lo <= e <= hi and pick(e) and not (e == pos and text[pos - 1:pos] == "\r"):
                    yield e
        for pos in at(" "):
            if lo <= pos <= hi and pick(pos) and not text[pos - 1:pos] == " ":
                yield pos


def _regions(lo: int, hi: int, size: int, reverse: bool) -> Iterator[tuple[int, int]]:
    """``[lo, hi]`` in spans of ``size``, from the right when ``reverse``."""
    if reverse:
        for r_hi in range(hi, lo - 1, -size):
            yield max(lo, r_hi - size + 1), r_hi
    else:
        for r_lo in range(lo, hi + 1, size):
            yield r_lo, min(hi, r_lo + size - 1)


def _boundary(splits: list, starts: list[int], e: int) -> int | None:
    """The index of the first pre-token of ``splits`` (sorted, original offsets) at or after ``e``,
    when one is and none before it reaches past ``e``."""
    i = bisect.bisect_left(starts, e)
    if i == len(starts) or i == 0 or any(b > e for _, (_, b) in splits[max(0, i - 4):i]):
        return None
    return i
