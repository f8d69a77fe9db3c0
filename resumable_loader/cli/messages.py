"""The CLI's one kind of failure, and the helpers its messages name what a file holds with.

Everything the CLI refuses -- a file it cannot read, a key that is not there, a state that
cannot be skipped -- is a ``CliError``, which ``main`` prints as one line on stderr with exit
status 2, never as a traceback: the reader of the message is someone pointing the tool at a
file, not debugging it. What a file holds goes into those lines through the helpers below, so
that a checkpoint with ten thousand keys or an exception with a page of text still makes one
readable line.
"""

from __future__ import annotations

from typing import Any

from ..state.codec import clip_text

# How many keys a message or the summary lists: enough to recognise a checkpoint's layout,
# short enough to read.
SHOW_KEYS = 20


class CliError(Exception):
    """Bad input: reported as one line on stderr with exit status 2, never as a traceback."""


def kind_of(value: Any) -> str:
    """What a value is, for a message: ``'a list'``, ``'a Tensor'``."""
    return f"a {type(value).__name__}"


def list_keys(keys: Any) -> str:
    """The keys of a dict (or any iterable of keys) as one line, the first ``SHOW_KEYS`` of
    them; strings as they are, other keys by ``repr``."""
    names = [repr(k) if not isinstance(k, str) else k for k in keys]
    shown = ", ".join(names[:SHOW_KEYS])
    return shown + (f", ... ({len(names)} in all)" if len(names) > SHOW_KEYS else "")


def first_line(text: str) -> str:
    """An exception's message cut to its first non-blank line, clipped to 200 characters:
    torch's unpickling errors run to a page of advice that would bury the one line we print."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return clip_text(lines[0], 200) if lines else "no message"
