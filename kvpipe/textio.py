"""Text in and out of `kvpipe generate`: the prompt (inline, a file or standard input; text or
token ids), the chat template, and the output as text streamed while it is generated. Streaming
is incremental detokenisation: a token that ends inside a multi-byte character waits for the
next, and text that may be the start of a stop string is held back until it is not."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = ("text", "ids")
_PARTIAL = "\ufffd"   # what a tokenizer decodes an incomplete UTF-8 sequence to


def read_prompt(prompt: str | None, prompt_file: str | os.PathLike | None, stdin=None) -> str:
    """The prompt's raw text: `prompt`, else the file's contents, else `stdin` (a file object,
    None when it is a terminal). ValueError names the flag."""
    if prompt is not None and prompt_file is not None:
        raise ValueError("prompt: give --prompt or --prompt-file, not both")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected text, got {type(prompt).__name__}")
        text, where = prompt, "prompt"
    elif prompt_file is not None:
        try:
            text = Path(prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"prompt-file: cannot read {str(prompt_file)!r} "
                             f"({getattr(e, 'strerror', None) or e})") from None
        where = "prompt-file"
    elif stdin is not None:
        text, where = stdin.read(), "stdin"   # no flag to name: standard input itself
    else:
        raise ValueError("prompt: give --prompt TEXT, --prompt-file FILE or the prompt on standard input")
    if not text.strip():
        raise ValueError(f"{where}: the prompt is empty")
    return text


def ids_text(prompt) -> str:
    """Token ids given from Python (a list or tuple of ints, or a 1-D tensor or array, as HF's
    input_ids; a [1, n] one too) as --prompt-format ids text. ValueError names `prompt`."""
    if getattr(prompt, "ndim", 1) == 2 and len(prompt) == 1:   # HF's [batch 1, n]
        prompt = prompt[0]
    if getattr(prompt, "ndim", 1) != 1 or not isinstance(prompt, (list, tuple)) and not hasattr(prompt, "tolist"):
        raise ValueError(f"prompt: expected text or token ids (a list of ints, a 1-D tensor), got {type(prompt).__name__}")
    ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise ValueError(f"prompt: token ids must be ints, got {bad[0]!r}")
    if not ids:
        raise ValueError("prompt: no token ids")
    return " ".join(map(str, ids))


def parse_ids(text: str, vocab: int, flag: str = "prompt") -> list[int]:
    """Whitespace-separated token ids (--prompt-format ids), each in [0, vocab)."""
    try:
        ids = [int(w) for w in text.split()]
    except ValueError:
        bad = next(w for w in text.split() if not w.lstrip("+-").isdigit())
        raise ValueError(f"{flag}: --prompt-format ids takes whitespace-separated token ids, got {bad!r}") from None
    out = [i for i in ids if not 0 <= i < vocab]
    if out:
        raise ValueError(f"{flag}: token id {out[0]} is outside the vocabulary (0 to {vocab - 1})")
    return ids


def encode(tok, text: str, chat: bool, system: str | None) -> tuple[list[int], bool]:
    """Prompt ids and whether the chat template was applied: by default where the tokenizer has
    one (a user turn, after `system` if given, and the assistant's turn opened), else plain."""
    template = getattr(tok, "chat_template", None)
    if system is not None and not (chat and template):
        raise ValueError("system: needs the chat template (the tokenizer has none, or --no-chat was given)")
    if chat and template:
        turns = ([{"role": "system", "content": system}] if system is not None else []) + \
                [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        return [int(i) for i in ids], True
    ids = tok(text)["input_ids"]
    if not ids:
        raise ValueError("prompt: tokenizes to no tokens")
    return list(ids), False


class Detokenizer:
    """Text of a growing list of token ids, piece by piece: each new piece is the decode of the
    tokens since the last piece's start minus the decode of what came before, so tokenizers that
    drop a leading space at a sequence's start (SentencePiece) decode the same as in one go."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0    # where the context of the next decode starts
        self.read = 0      # tokens already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith(_PARTIAL) or len(after) <= len(before):
            return ""      # inside a multi-byte character, or a token with no text
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """What is left once no more tokens come (an incomplete character as U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""


@dataclass
class Output:
    """The host side of one generation: takes each token in order, decides when it ends (an
    end-of-sequence id unless `ignore_eos`, a stop string, or `max_new` tokens) and streams the
    text to `stream` (None: nothing printed). The text excludes the EOS token and the stop string
    (and what follows it); `tokens` keep every generated id up to the one that ended it. Without
    a tokenizer (`tok` None) the ids themselves are streamed and `text` stays None."""

    tok: object | None
    max_new: int
    eos: frozenset = frozenset()
    stops: tuple[str, ...] = ()
    stream: Callable[[str], None] | None = None
    tokens: list[int] = field(default_factory=list)
    text: str | None = ""
    finish_reason: str | None = None
    _shown: int = 0
    _at_stop: bool = False

    def __post_init__(self) -> None:
        self.detok = Detokenizer(self.tok) if self.tok is not None else None
        if self.detok is None:
            self.text = None
        self.hold = max((len(s) for s in self.stops), default=1) - 1   # characters a stop may still begin in

    def take(self, i: int, token: int) -> bool:
        """Token i of the output; True when the generation ends with it."""
        assert i == len(self.tokens), (i, len(self.tokens))
        self.tokens.append(token)
        if token in self.eos:
            self.finish_reason = "stop"
        elif self.detok is None:
            self._emit(f"{token} ")
        else:
            before = len(self.text)
            self.text += self.detok.push(token)
            self._at_stop = self._cut_at_stop(before)
            self.finish_reason = "stop" if self._at_stop else None
        if self.finish_reason is None and len(self.tokens) >= self.max_new:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.close()
            return True
        if self.detok is not None:
            self._emit(self.text[self._shown:max(self._shown, len(self.text) - self.hold)])
        return False

    def _cut_at_stop(self, before: int) -> bool:
        """Cut the text at the first stop string ending past `before` (the text up to it had none)."""
        start = max(0, before - self.hold)
        hits = [h for h in (self.text.find(s, start) for s in self.stops) if h >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def close(self) -> None:
        """The end (once): the last bytes decoded, the held-back text shown."""
        if self.detok is not None and not self._at_stop:
            before = len(self.text)
            self.text += self.detok.flush()
            if self._cut_at_stop(before):
                self._at_stop, self.finish_reason = True, "stop"
        self.finish_reason = self.finish_reason or "length"
        if self.detok is not None:
            self._emit(self.text[self._shown:])

    def _emit(self, piece: str) -> None:
        if self.detok is not None:
            self._shown += len(piece)
        if self.stream is not None and piece:
            self.stream(piece)


def taker(out: Output, cancel, interrupt=None) -> tuple:
    """(take, why) for the engine's Decoding: `take(i, token)` is True at the end of the output or
    once `cancel()` or `interrupt()`, asked after each token, is True; `why` then holds the finish
    reason, "cancelled" or "interrupted" (empty: neither came)."""
    why: list[str] = []

    def take(i: int, token: int) -> bool:
        if out.take(i, token):
            return True
        if cancel is not None and cancel():
            why.append("cancelled")
        elif interrupt is not None and interrupt():
            why.append("interrupted")
        return bool(why)
    return take, why
