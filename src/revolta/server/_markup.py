"""Finding markup tags in text that arrives in pieces: the scans the tool-call and reasoning parsers share.

A streaming parser may only pass text on once it knows the text is not the start of a tag, so every
scan here also reports where a tag may begin but is cut off by the end of the text seen so far.
"""

from __future__ import annotations

from collections.abc import Sequence

# Returned by `match_tag` when the text ends before it can tell (the tag may still arrive).
PARTIAL = "partial"


def find_tag(text: str, tags: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    """The earliest place at or after `start` where one of `tags` begins, complete or cut off.

    Returns:
        (i, tag) when text[i:] starts with `tag`; (i, None) when text[i:] is a proper prefix of one
        of the tags (text ends inside it, so the caller holds text[i:] back); (len(text), None) when
        neither occurs. Of a complete and a cut-off candidate the earlier one wins.
    """
    best, best_tag = len(text), None
    for tag in tags:
        i = text.find(tag, start)
        if i != -1 and i < best:
            best, best_tag = i, tag
    # Only a tail shorter than the longest tag can be a cut-off tag.
    longest = max(map(len, tags))
    for i in range(max(start, len(text) - longest + 1), min(best, len(text))):
        tail = text[i:]
        if any(len(tail) < len(tag) and tag.startswith(tail) for tag in tags):
            return i, None
    return best, best_tag


def match_tag(text: str, i: int, tags: Sequence[str]) -> str | None:
    """Which of `tags` text[i:] starts with: the tag, PARTIAL when text[i:] is a proper prefix of one
    (or empty), or None when it cannot be any of them."""
    for tag in tags:
        if text.startswith(tag, i):
            return tag
    # Slice only a tail shorter than the tag: values can be long, and this runs at every `<`.
    if any(len(text) - i < len(tag) and tag.startswith(text[i:]) for tag in tags):
        return PARTIAL
    return None


def skip_space(text: str, i: int) -> int:
    """The first index at or after i that is not whitespace (len(text) if none)."""
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def space_run_start(text: str, end: int) -> int:
    """Where the run of whitespace that ends at `end` begins (`end` if text[end - 1] is not space)."""
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return end


class StreamScanner:
    """Base of the streaming parsers: undecided text waits in `_buf`, and `_step(final)` (the
    subclass's state machine) decides as much of it as it can. `_step` returns True when it moved
    on (call again) and False when it needs more text; with final=True it must settle everything.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._finished = False

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _scan(self, text: str) -> None:
        """Add text and decide what can be decided (the body of a subclass's feed())."""
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}.feed() called after finish(); use a new parser per choice")
        self._buf += text
        while self._step(False):
            pass

    def _scan_final(self) -> bool:
        """Settle all held text (the body of finish()); False when finish() already ran."""
        if self._finished:
            return False
        self._finished = True
        while self._step(True):
            pass
        return True

    def _take(self, n: int) -> str:
        """Remove and return the first n characters of the buffer."""
        taken, self._buf = self._buf[:n], self._buf[n:]
        return taken

    def _drop_leading_space(self) -> bool:
        """Drop whitespace at the start of the buffer; True when other text follows it."""
        self._take(skip_space(self._buf, 0))
        return bool(self._buf)
