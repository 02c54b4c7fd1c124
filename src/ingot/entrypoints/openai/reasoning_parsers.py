"""``--reasoning-parser``: split a response into ``reasoning`` (inside ``<think>...</think>``)
and content. Like the tool parsers, ``parse(text, final)`` is a pure function of the text so
far whose two parts only grow, so streamed ``delta.reasoning`` / ``delta.content`` concatenate
to the whole response's ``message.reasoning`` / ``message.content``.

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the response starts
  in reasoning (an opening tag in the output is skipped); everything up to ``</think>`` is
  reasoning, all of it if the tag never comes.
- ``qwen3``: reasoning only when the response opens with ``<think>`` (thinking can be off);
  then as above.

A constraint (structured outputs, a required or named tool choice) applies to the content: the
server hands the engine the token ids of ``</think>`` and the grammar starts after them.
"""

from __future__ import annotations

from ingot.entrypoints.openai.tool_parsers.base import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    name = "base"
    starts_in_reasoning = True

    @staticmethod
    def response_reasons(prompt: str) -> bool:
        """Whether a response to ``prompt`` starts with reasoning: not when the template
        already closed the think block (Qwen3 with enable_thinking false)."""
        return not prompt.rstrip().endswith(END)

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        if rest.startswith(START):
            begin = lead + len(START)
        elif not final and START.startswith(rest):
            return "", ""  # may still become the opening tag
        elif self.starts_in_reasoning:
            begin = 0
        else:
            return "", text
        end = text.find(END, begin)
        if end < 0:
            if final:
                return text[begin:], ""
            return text[begin : len(text) - held_back(text, END)], ""
        # Whitespace between the reasoning and the answer belongs to neither.
        return text[begin:end], text[end + len(END):].lstrip()


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {name!r} is not known; choose from "
            f"{', '.join(sorted(REASONING_PARSERS))}"
        )
    return REASONING_PARSERS[name]
