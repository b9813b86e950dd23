"""From committed token blocks to streamed text: incremental decoding and stop strings.

The text a client sees is ``tokenizer.decode(ids, skip_special_tokens=True)`` of the generated ids, read after the
prompt's last :data:`CONTEXT` ids where the decoder strips the first space of what it decodes (SentencePiece's,
:func:`strips_first_space`: ``"▁Pa"`` first is ``" Pa"`` after the prompt, as vLLM gives it). Text is
handed out as soon as it is final: not while it ends in an incomplete UTF-8 sequence (``"\\ufffd"``), and not
the tail that could still become a stop string. With stop strings the ids are decoded one token at a time, so
the generation is cut at the token that completes the first stop string and the text just before it.

Decoding every id again for every block costs time in proportion to the answer (about 0.2 ms at 1,000 tokens and
0.9 ms at 4,000 for SmolLM2's tokenizer, on the thread that runs the batch's passes). Where decoding is a
concatenation (a byte-level BPE decoder, :func:`decodes_by_concatenation`: the ids' bytes joined, then read as
UTF-8 with replacement, no clean-up), the text of the ids up to a point where it ends in a whole character is kept
and only the ids after it are decoded again: the same text, from a window of at least :data:`WINDOW` ids.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Ids after the kept text that each decode reads at least once it is kept (a kept point moves on once this many
#: ids past it decode to text ending in a whole character).
WINDOW = 8
#: The prompt's last ids the generated ids are decoded after, by a decoder that strips the first space
#: (:func:`strips_first_space`).
CONTEXT = 4


def decodes_by_concatenation(tokenizer: "PreTrainedTokenizerBase") -> bool:
    """Whether ``decode(a + b) == decode(a) + decode(b)`` whenever ``decode(a)`` ends in a whole character: a fast
    tokenizer whose decoder is byte-level (each token's bytes joined, then read as UTF-8 with replacement) and
    that cleans up no spaces. Other decoders (SentencePiece's, which strip the first space; WordPiece's) are
    decoded whole every time."""
    return _byte_level(tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True)


@functools.lru_cache(maxsize=16)
def _decoder_types(tokenizer: "PreTrainedTokenizerBase") -> tuple[str, ...]:
    """The types of a fast tokenizer's decoder steps (``("Replace", "ByteFallback", ...)`` for a sequence of them;
    empty where it has no ``tokenizers`` decoder)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return ()
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return (type(decoder).__name__,)
    return tuple(d.get("type") for d in state.get("decoders", [state]))


def strips_first_space(tokenizer: "PreTrainedTokenizerBase") -> bool:
    """Whether the decoder drops the space that starts what it decodes (SentencePiece's: a ``Strip`` of one leading
    space after ``"▁"`` became spaces, or a ``Metaspace`` decoder): an answer decoded alone would lose its first
    space, so it is read after the prompt's last ids."""
    return any(t in ("Strip", "Metaspace") for t in _decoder_types(tokenizer))


def _byte_level(tokenizer: "PreTrainedTokenizerBase") -> bool:
    """Whether ``tokenizer`` is a fast tokenizer with a byte-level decoder (each token's bytes joined, then read as
    UTF-8)."""
    return _decoder_types(tokenizer) == ("ByteLevel",)


class TextStream:
    """Feed it the blocks of token ids the target commits; it returns the new text each block makes final.

    Attributes:
        ids: every id fed so far (up to and including the token that completed a stop string).
        text: the text handed out so far.
        stopped: a stop string was found (``text`` ends just before it and ``ids`` at the token completing it), or a
            token of ``stop_ids`` was fed (``ids`` end with it; ``text`` holds its text unless it is a special
            token, as vLLM's ``stop_token_ids``).
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", stop: Sequence[str] = (), context: Sequence[int] = (),
                 stop_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # chars that may start a stop string
        self._searched = 0  # stop strings were searched in full[:self._searched] without a hit
        self._concat = decodes_by_concatenation(tokenizer)
        self._kept_ids = 0  # ids[:_kept_ids] decode to _kept_text, which ends in a whole character
        self._kept_text = ""
        self._context = [int(t) for t in context[len(context) - CONTEXT:]] if strips_first_space(tokenizer) else []
        self._context_text = tokenizer.decode(self._context, skip_special_tokens=True) if self._context else ""

    def _decode(self) -> str:
        """``decode(ids)``; by concatenation, the kept text and the ids after it decoded (moving the kept point
        on once at least :data:`WINDOW` ids after it end in a whole character)."""
        if not self._concat:
            if self._context:
                full = self.tokenizer.decode(self._context + self.ids, skip_special_tokens=True)
                if full.startswith(self._context_text):
                    return full[len(self._context_text):]
            return self.tokenizer.decode(self.ids, skip_special_tokens=True)
        tail = self.tokenizer.decode(self.ids[self._kept_ids:], skip_special_tokens=True)
        full = self._kept_text + tail
        if len(self.ids) - self._kept_ids >= WINDOW and not tail.endswith("\ufffd"):
            self._kept_ids, self._kept_text = len(self.ids), full
        return full

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
        or a stop id nothing more is taken."""
        if self.stopped:
            return ""
        if not self.stop and not self.stop_ids:
            self.ids.extend(int(t) for t in block)
            return self._advance(self._decode())
        out = []
        for t in block:
            self.ids.append(int(t))
            full = self._decode()
            whole = full.rstrip("\ufffd")     # the text before a character whose bytes are still coming
            cut = self._find_stop(whole)      # final already: a stop string in it ends the text at this token
            if cut >= 0 or int(t) in self.stop_ids:
                self.stopped = True
                out.append(self._advance(full[:cut] if cut >= 0 else full, final=True))
                break
            if whole == full:
                out.append(self._advance(full))
        return "".join(out)

    def finish(self) -> str:
        """The generation ended (EOS, ``max_tokens``, a stop string): the text still held back, up to a stop
        string where the whole text holds one (:attr:`stopped` then)."""
        if self.stopped:
            return ""
        full = self._decode()
        cut = self._find_stop(full) if self.stop else -1
        if cut >= 0:
            self.stopped = True
            return self._advance(full[:cut], final=True)
        return self._advance(full, final=True)


def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet back to bytes (GPT-2's ``bytes_to_unicode``, inverted): printable bytes stand
    for themselves, the others for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: "PreTrainedTokenizerBase", token_id: int) -> bytes:
    """The bytes token ``token_id`` stands for: a byte-level BPE token's own bytes (part of a character, maybe); a
    SentencePiece token's piece with ``"▁"`` as a space (``"▁Pa"``: ``b" Pa"``), its byte fallback ``<0xE2>`` as
    that byte; else its text alone in UTF-8 (special tokens included)."""
    types = _decoder_types(tokenizer)
    if _byte_level(tokenizer):
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str) and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    elif "Replace" in types:
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
        byte = _BYTE_PIECE.fullmatch(piece) if isinstance(piece, str) and "ByteFallback" in types else None
        if byte:
            return bytes([int(byte.group(1), 16)])
        if isinstance(piece, str) and int(token_id) not in _special_ids(tokenizer):
            return piece.replace("\u2581", " ").encode("utf-8")
    return tokenizer.decode([int(token_id)]).encode("utf-8")


@functools.lru_cache(maxsize=16)
def _special_ids(tokenizer: "PreTrainedTokenizerBase") -> frozenset[int]:
    """The ids of the fast tokenizer's special tokens (their text is what ``decode`` gives, not a piece)."""
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    return frozenset(i for i, t in added.items() if t.special)


def bytes_text(b: bytes) -> str:
    """A token's bytes read as UTF-8, U+FFFD for a character's first bytes cut short and for each lone
    continuation byte (``errors="replace"``)."""
    return b.decode("utf-8", errors="replace")


def token_text(tokenizer: "PreTrainedTokenizerBase", token_id: int) -> str:
    """Token ``token_id`` alone as text: :func:`bytes_text` of :func:`token_bytes`."""
    return bytes_text(token_bytes(tokenizer, token_id))
