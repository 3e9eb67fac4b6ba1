"""Where each spoken sentence came from: the character span of the request text behind each piece that the text
preprocessor made (speech marks, pipeline/speech_marks.py).

The preprocessor normalizes first and splits after (preprocess/text.py), so its sentences are not substrings of
the request text ("12" became "twelve", "." became "。"). `source_spans` aligns the sentences, joined, with the
source text (difflib's longest matching blocks, no junk heuristic) and maps each boundary between two sentences
back to the source: a boundary inside text that both share maps to the same place in the source; a boundary
inside a stretch that normalization changed maps to the end of that stretch in the source (the whole changed
stretch belongs to the sentence before). Sentences end at punctuation, which normalization keeps, so the
boundaries land after the source's own sentence marks; closing brackets and quotes right after a boundary (which
normalization may drop) stay with the sentence they close. The spans are then in order, never overlap, together
cover the source but for white space between them, and are trimmed of white space at both ends.
"""
from __future__ import annotations

import bisect
from difflib import SequenceMatcher

Span = tuple[int, int]
CLOSING = frozenset(")]}\"'”’」』）】》")


def source_spans(source: str, pieces: list[str]) -> list[Span]:
    """The (start, end) character span of `source` behind each of `pieces` (the sentences made of it, in order)."""
    if not pieces:
        return []
    if len(pieces) == 1:
        return [trimmed(source, 0, len(source))]
    joined = "".join(pieces)
    opcodes = SequenceMatcher(None, joined, source, autojunk=False).get_opcodes()
    op_ends = [i2 for _, _, i2, _, _ in opcodes]
    cuts, at = [], 0
    for piece in pieces[:-1]:
        at += len(piece)
        cut = _to_source(opcodes, op_ends, at)
        while cut < len(source) and source[cut] in CLOSING:
            cut += 1
        cuts.append(cut)
    bounds = [0, *cuts, len(source)]
    for i in range(1, len(bounds)):  # in order, whatever the alignment did
        bounds[i] = max(bounds[i], bounds[i - 1])
    return [trimmed(source, bounds[i], bounds[i + 1]) for i in range(len(pieces))]


def _to_source(opcodes: list[tuple], op_ends: list[int], at: int) -> int:
    """The source offset of a boundary `at` characters into the joined pieces (after character at - 1)."""
    tag, i1, _, j1, j2 = opcodes[min(bisect.bisect_left(op_ends, at), len(opcodes) - 1)]  # the op that holds it
    return j1 + (at - i1) if tag == "equal" else j2


def trimmed(text: str, start: int, end: int) -> Span:
    """(start, end) without the white space at either end (an empty span where there is only white space)."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end
