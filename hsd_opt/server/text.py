"""From committed token blocks to streamed text: incremental decoding and stop strings.

The text a client sees is ``tokenizer.decode(ids, skip_special_tokens=True)`` of the generated ids. Text is
handed out as soon as it is final: not while it ends in an incomplete UTF-8 sequence (``"\\ufffd"``), and not
the tail that could still become a stop string. With stop strings the ids are decoded one token at a time, so
the generation is cut at the token that completes the first stop string and the text just before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextStream:
    """Feed it the blocks of token ids the target commits; it returns the new text each block makes final.

    Attributes:
        ids: every id fed so far (up to and including the token that completed a stop string).
        text: the text handed out so far.
        stopped: a stop string was found; ``text`` ends just before it and ``ids`` at the token completing it.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # chars that may start a stop string
        self._searched = 0  # stop strings were searched in full[:self._searched] without a hit

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _held(self, full: str) -> int:
        """Length of the longest tail of ``full`` that is a proper prefix of a stop string."""
        for k in range(min(self._hold, len(full)), 0, -1):
            tail = full[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _advance(self, full: str, final: bool = False) -> str:
        """Hand out what ``full`` adds to :attr:`text` (all of it when ``final``)."""
        if not final:
            if full.endswith("\ufffd"):
                return ""
            if self.stop and not self.stopped:
                full = full[: len(full) - self._held(full)]
        if not full.startswith(self.text):  # the decoder changed earlier text: wait (or hand out the rest)
            if not final:
                return ""
            full = self.text + full[len(self.text):]
        delta = full[len(self.text):]
        self.text = full
        return delta

    def _find_stop(self, full: str) -> int:
        start = max(0, self._searched - self._hold)
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            return min(hits)
        self._searched = len(full)
        return -1

    def feed(self, block: Sequence[int]) -> str:
        """Take one committed block of ids; return the text it makes final ('' if none). After a stop string
        nothing more is taken."""
        if self.stopped:
            return ""
        if not self.stop:
            self.ids.extend(int(t) for t in block)
            return self._advance(self._decode())
        out = []
        for t in block:
            self.ids.append(int(t))
            full = self._decode()
            if full.endswith("\ufffd"):
                continue
            cut = self._find_stop(full)
            if cut >= 0:
                self.stopped = True
                out.append(self._advance(full[:cut]))
                break
            out.append(self._advance(full))
        return "".join(out)

    def finish(self) -> str:
        """The generation ended (EOS, ``max_tokens``, a stop string): the text still held back."""
        if self.stopped:
            return ""
        return self._advance(self._decode(), final=True)
