"""Token pieces in, text out: only whole characters, never into or past a stop string."""

from __future__ import annotations

from typing import Callable, Sequence

from jetflow_jax.text import stop_end

INCOMPLETE = "\ufffd"  # what a byte-level decode gives for a character still missing bytes


class TextStream:
  """Incremental detokenizing with stop strings, for one request.

  Each `push` returns the text that is now safe to send: it holds back a character whose bytes
  have not all arrived, and text that could be the start of a stop string. Once a stop string
  appears, `stopped` is set and the text ends just before it. Everything `push` ever returned,
  concatenated, is `text`, and is a prefix of the final output.
  """

  def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
    self.decode, self.stop = decode, tuple(stop)
    self.tokens: list[int] = []
    self.text = ""  # sent so far
    self.stopped = False
    self._decoded = ""  # text of tokens[:_start], whole characters only
    self._start = 0

  def push(self, piece: Sequence[int], final: bool = False) -> str:
    """The new text `piece` makes safe to send; with `final`, everything left."""
    self.tokens.extend(piece)
    # Byte-level BPE decodes a split at a character boundary piecewise, so only the tail
    # since the last whole character is decoded again.
    tail = self.decode(self.tokens[self._start:])
    if not tail.endswith(INCOMPLETE):
      self._decoded, self._start, tail = self._decoded + tail, len(self.tokens), ""
    full = self._decoded + (tail if final else tail.rstrip(INCOMPLETE))
    # What was sent can hold no stop string, nor the start of one (see `_held_back`).
    found = [i for i in (full.find(s, len(self.text)) for s in self.stop) if i >= 0]
    if found:
      end, self.stopped = min(found), True
    else:
      end = len(full) if final else len(full) - self._held_back(full)
    new = full[len(self.text):end]
    self.text += new
    return new

  @property
  def output_tokens(self) -> list[int]:
    """The tokens the answer used: through the one that completes the stop string, if one
    was found (the engine may have made a few more before it was cancelled)."""
    end = stop_end(self.tokens, self.stop, self.decode) if self.stopped else None
    return self.tokens[:end]

  def _held_back(self, full: str) -> int:
    """Length of the longest end of `full` that begins some stop string."""
    return max((n for s in self.stop for n in range(1, len(s)) if full.endswith(s[:n])),
               default=0)
