"""One answer to a prompt (a choice): the engine's tokens as text safe to send, the tokens that
text used, and their log-probabilities as OpenAI shows them.

`Choice.pieces` turns a job's token pieces into `Piece`s: the echoed prompt first, then text
with the log-probabilities of the tokens whose text it completes, the finish reason last. A
stop string cuts the log-probabilities where it cuts the tokens (through the one completing it).
"""

from __future__ import annotations

import codecs
import dataclasses
from typing import AsyncIterator, NamedTuple, Sequence

from jetflow_jax.serve.protocol import FINISH_REASONS, TokenLogprob
from jetflow_jax.serve.service import Job, Unavailable
from jetflow_jax.serve.textstream import TextStream


def byte_level_alphabet() -> dict[str, int]:
  """GPT-2's byte-level BPE alphabet (Qwen's too): the character standing for each byte."""
  printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)}
  alphabet, shifted = {}, 0
  for byte in range(256):
    if byte in printable:
      alphabet[chr(byte)] = byte
    else:  # the unprintable bytes take the characters from 256 on, in order
      alphabet[chr(256 + shifted)] = byte
      shifted += 1
  return alphabet


class Token(NamedTuple):
  string: str  # as logprobs show it: its text, or "bytes:\xe4\xb8" for part of a character
  bytes: bytes
  skipped: bool  # a special token: the answer's text leaves it out


class TokenTexts:
  """Each token id's bytes and string, looked up once per id."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._alphabet = byte_level_alphabet()
    self._known: dict[int, Token] = {}

  def __call__(self, token: int) -> Token:
    if token not in self._known:
      piece = self.tokenizer.convert_ids_to_tokens(token)
      text = self.tokenizer.decode([token], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
      if all(c in self._alphabet for c in piece):
        raw = bytes(self._alphabet[c] for c in piece)
      else:  # not byte-level (or an added token spelled outside its alphabet): its text
        raw = text.encode()
      try:
        string = raw.decode()
      except UnicodeDecodeError:
        string = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
      skipped = not self.tokenizer.decode([token], skip_special_tokens=True)
      self._known[token] = Token(string, raw, skipped)
    return self._known[token]

  def logprob(self, token: int, logprob: float | None, top, offset: int) -> TokenLogprob:
    """`token` with its log-probability and its alternatives ((id, log-probability) pairs)."""
    shown = lambda t: self(t)[:2]
    return TokenLogprob(*shown(token), logprob,
                        None if top is None else [(*shown(t), value) for t, value in top], offset)


class Offsets:
  """Where each token's text starts and ends in the text (characters), token by token: its
  bytes decoded as UTF-8 as they come, so a token ending inside a character ends after it."""

  def __init__(self, texts: TokenTexts, start: int = 0):
    self.texts = texts
    self.chars = start
    self.starts: list[int] = []
    self.ends: list[int] = []
    self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

  def extend(self, tokens: Sequence[int]) -> None:
    for token in tokens:
      self.starts.append(self.chars)
      raw, skipped = self.texts(token)[1:]
      if not skipped:
        self.chars += len(self._utf8.decode(raw))
      self.ends.append(self.chars + bool(self._utf8.getstate()[0]))


@dataclasses.dataclass
class Piece:
  """Text to send, the log-probabilities of the tokens it completes, and the end's reason."""

  text: str
  logprobs: list[TokenLogprob]
  finish_reason: str | None = None


class Choice:
  """One job's answer, piece by piece (`pieces`); `text`, `tokens` and `logprobs` hold what has
  gone out, the whole answer once `pieces` has ended.

  `echo` is the prompt's text, sent first (with its tokens' log-probabilities: the first has
  none); `prompt_only` drops what the engine generated (max_tokens 0 with echo). Log-
  probabilities go out only with `logprobs`; the job must have been asked for them.
  """

  def __init__(self, job: Job, text: TextStream, texts: TokenTexts, *, echo: str | None = None,
               prompt_only: bool = False, logprobs: bool = False):
    self.job, self.texts, self._text = job, texts, text
    self.echo, self.prompt_only, self.show_logprobs = echo, prompt_only, logprobs
    self.text = ""
    self.logprobs: list[TokenLogprob] = []
    self.finish_reason: str | None = None
    self._offsets = Offsets(texts, len(echo or ""))
    self._released = 0  # generated tokens whose log-probabilities have gone out

  @property
  def tokens(self) -> list[int]:
    """The generated tokens the answer used."""
    return [] if self.prompt_only else self._text.output_tokens

  @property
  def mean_logprob(self) -> float:
    """The mean log-probability of `tokens` (best_of ranks by it); 0 for none."""
    count = len(self.tokens)
    return sum(self.job.stream.logprobs[:count]) / count if count else 0.0

  async def pieces(self) -> AsyncIterator[Piece]:
    """Pieces as they are safe to send; the job is cancelled once the answer is whole."""
    try:
      started = False
      async for piece in self.job.pieces():
        if not started:
          started = True
          if self.echo is not None:
            yield self._echoed()
          if self.prompt_only:
            yield self._piece("", 0, "length")
            return
        new = self._text.push(piece)
        self._offsets.extend(piece)
        if self._text.stopped:
          yield self._piece(new, len(self.tokens), "stop")
          return
        covered = self._covered()
        if new or covered > self._released:
          yield self._piece(new, covered)
      if self.job.finish_reason == "cancelled":
        raise Unavailable("the request was cancelled: the server is shutting down")
      new = self._text.push([], final=True)
      reason = "stop" if self._text.stopped else FINISH_REASONS[self.job.finish_reason]
      yield self._piece(new, len(self.tokens), reason)
    finally:
      self.job.cancel()  # frees the slot at once (a no-op once the job has finished)

  def _covered(self) -> int:
    """How many generated tokens lie wholly inside the text sent, with this piece's."""
    sent, ends = len(self.echo or "") + len(self._text.text), self._offsets.ends
    count = self._released
    while count < len(ends) and ends[count] <= sent:
      count += 1
    return count

  def _piece(self, text: str, count: int, reason: str | None = None) -> Piece:
    """`text`, with the log-probabilities of the generated tokens up to `count`."""
    logprobs = []
    if self.show_logprobs:
      stream, end = self.job.stream, len(self.echo or "") + len(self._text.text)
      logprobs = [self.texts.logprob(self._text.tokens[i], stream.logprobs[i],
                                     stream.top_logprobs[i], min(self._offsets.starts[i], end))
                  for i in range(self._released, count)]
    self._released = max(self._released, count)
    self.text += text
    self.logprobs += logprobs
    self.finish_reason = reason
    return Piece(text, logprobs, reason)

  def _echoed(self) -> Piece:
    """The prompt's text and, with `logprobs`, its tokens' (ready once the job has a piece)."""
    logprobs = []
    if self.show_logprobs:
      prompt, stream = list(self.job.request.prompt), self.job.stream
      offsets = Offsets(self.texts)
      offsets.extend(prompt)
      logprobs = [self.texts.logprob(token, logprob, top, min(start, len(self.echo)))
                  for token, logprob, top, start in zip(prompt, stream.prompt_logprobs,
                                                        stream.prompt_top_logprobs,
                                                        offsets.starts)]
    self.text += self.echo
    self.logprobs += logprobs
    return Piece(self.echo, logprobs)
