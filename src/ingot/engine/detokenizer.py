"""Incremental detokenization with stop-string handling.

Each step decodes only a small window of token ids (from ``prefix_offset``): the text of the
window minus the text of its already-emitted part is the new text. A window whose text ends in
U+FFFD is an incomplete UTF-8 sequence split across tokens; it is held back until the next
token completes it, so multi-byte characters are never split.
"""

from __future__ import annotations

from typing import Any

# Tokens of prompt context decoded before the first output token, so tokenizers that drop a
# leading space at the start of a string (SentencePiece) decode the continuation correctly.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""
        self.num_output_tokens = 0
        self._sent_offset = 0
        max_stop = max((len(s) for s in self.stop), default=0)
        self._stop_buffer = 0 if self.include_stop else max(max_stop - 1, 0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, token_id: int, flush: bool) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (flush or not new_text.endswith("\ufffd")):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def update(self, new_token_ids: list[int], finishing: bool = False) -> str | None:
        """Append tokens; returns the stop string that matched (text already truncated), if any."""
        for i, token_id in enumerate(new_token_ids):
            last = finishing and i == len(new_token_ids) - 1
            delta = self._step(token_id, flush=last)
            self.num_output_tokens += 1
            if not delta:
                continue
            start = max(len(self.output_text) - self._stop_buffer_for_search(), 0)
            self.output_text += delta
            if self.stop and self.num_output_tokens > self.min_tokens:
                matched = self._check_stop(start)
                if matched is not None:
                    return matched
        return None

    def _stop_buffer_for_search(self) -> int:
        return max((len(s) for s in self.stop), default=1) - 1

    def _check_stop(self, search_start: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.output_text.find(s, search_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[: idx + len(s) if self.include_stop else idx]
        return s

    def flush(self) -> None:
        """Emit bytes held back for a possible multi-byte continuation (the request ended)."""
        tail = self._decode(self._ids[self._prefix_offset :])
        head = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if len(tail) > len(head):
            self.output_text += tail[len(head) :]
            self._prefix_offset = self._read_offset = len(self._ids)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show so far; while running, a possible stop-string prefix stays hidden."""
        length = len(self.output_text) if finished else len(self.output_text) - self._stop_buffer
        length = max(length, self._sent_offset if delta else 0)
        if not delta:
            return self.output_text[:length]
        text = self.output_text[self._sent_offset : length]
        self._sent_offset = length
        return text
