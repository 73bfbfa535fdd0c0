"""Client-supplied text, made safe to log and to quote back, and the rules for labels.

Anything a client sends (its name, region, device, codec names, metric names, failure
reasons, tensor names) may hold a newline, an ANSI escape or megabytes of text. Written to a
log verbatim it forges lines (``\\n[FAKE] round 9 committed``), recolours a terminal, or fills
the disk. ``escape`` is the one way such text reaches a log line or an error message: it is
``repr``'s escaping (every character ``str.isprintable`` rejects, ESC and newline included,
shown as ``\\x1b``, ``\\n``, ``\\u202e``), quoted, and cut at ``limit`` characters.

``check_label`` is what a label must be to be accepted at all (names, regions): at most
``limit`` characters, each of them printable in the sense of ``str.isprintable`` (letters,
digits, punctuation and the space of any script; no control, format or line/paragraph
separator characters). That keeps names in any language usable while refusing every
character that can move a cursor, end a line or reorder text on a screen.
"""

from __future__ import annotations

from fedgrid.errors import InvalidUpdateError

__all__ = ["escape", "check_label", "ESCAPE_LIMIT", "MAX_NAME_CHARS", "MAX_REGION_CHARS", "MAX_LABEL_CHARS"]

#: Characters of client text quoted in one log line or error message.
ESCAPE_LIMIT = 200
#: Longest client name accepted at Join.
MAX_NAME_CHARS = 128
#: Longest region accepted at Join.
MAX_REGION_CHARS = 64
#: Longest other label (device, codec name, metric name) a client sends.
MAX_LABEL_CHARS = 64


def escape(text: object, limit: int = ESCAPE_LIMIT) -> str:
    """``text`` quoted and escaped as ``repr`` does, cut to ``limit`` characters.

    A cut string ends with ``...(+N chars)`` so a reader knows it was longer. Non-string
    values are converted with ``str`` first (a client's bytes are never decoded here).
    """
    s = text if isinstance(text, str) else str(text)
    if len(s) <= limit:
        return repr(s)
    return f"{s[:limit]!r}...(+{len(s) - limit} chars)"


def check_label(text: str, *, what: str, limit: int) -> str:
    """Returns ``text`` if it is a valid label: at most ``limit`` printable characters.

    Raises:
        InvalidUpdateError: too long, or a character that is not printable (the message
            names the rule and the first offending character, escaped).
    """
    if len(text) > limit:
        raise InvalidUpdateError(
            f"{what}: {len(text)} characters, at most {limit} printable characters allowed"
        )
    for i, ch in enumerate(text):
        if not ch.isprintable():
            raise InvalidUpdateError(
                f"{what}: character {i} is {ch!r}; only printable characters are allowed (no control, escape, newline or format characters)"
            )
    return text
