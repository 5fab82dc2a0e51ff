"""How a tokenizer's chat template writes a conversation, read from the template itself: `TurnFormat` is one exchange
(the text around a user message, before and at the end of a reply) without any system prompt or BOS it adds. Chat
(`ChatSession`) talks to a model in it, and the built-in tasks write their chat turns in it."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

# Written as each message's text, then split on: what the template writes around a message.
SENTINEL = "CCM-MESSAGE-SENTINEL"


def apply_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    """`messages` as `tokenizer`'s chat template writes them. A template's own refusal (`raise_exception`: a template
    that needs a system message, say) is a ValueError: jinja's TemplateError ended `ccm chat` with a traceback."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as error:
        roles = ", ".join(message["role"] for message in messages)
        raise ValueError(
            f"The tokenizer's chat template refused a conversation of the roles {roles} ({error}); chat needs a "
            "template that writes user and assistant messages alone."
        ) from None


def render_turns(tokenizer: PreTrainedTokenizerBase, roles: str, generation_prompt: bool) -> str:
    """The conversation of one message per role in `roles` ("u": user, "a": assistant), each the sentinel, as
    `tokenizer`'s chat template writes it."""
    messages = [{"role": "user" if role == "u" else "assistant", "content": SENTINEL} for role in roles]
    return apply_template(tokenizer, messages, generation_prompt)


@dataclass(frozen=True)
class TurnFormat:
    """How the tokenizer's chat template writes one exchange, without any system prompt it may add.

    A user turn is `before_message + message + after_message` (the assistant's reply starts right after);
    a reply ends with `end_of_reply` (its first token after any leading whitespace is where generation stops).
    In the history the template writes `before_reply` (spaces) before a reply (Llama 2, Mistral v0.3: "[/INST] "
    + reply): a generated reply begins with it, and a written exchange holds it.
    """

    before_message: str
    after_message: str
    end_of_reply: str
    before_reply: str = ""

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TurnFormat:
        """Read the format from `tokenizer.apply_chat_template`: how it writes an exchange once the next message
        follows (Qwen3 writes the last reply otherwise, with an empty thinking block), and how it ends a reply."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template; chat needs an instruction-tuned model's "
                "tokenizer (or set tokenizer.chat_template)."
            )

        with_turn = render_turns(tokenizer, "uau", True)
        pieces = with_turn.split(SENTINEL)  # system prompt and before, after, end of reply and before, after
        written = [render_turns(tokenizer, roles, False) for roles in ("ua", "uau", "uaua")]
        # Some templates end a conversation without a generation prompt with a special token no turn holds (Phi-3:
        # the end of text); it is left out of each.
        endings = [ending for ending in tokenizer.all_special_tokens if all(text.endswith(ending) for text in written)]
        for ending in ["", *endings]:
            exchange, history, longer = (text[: len(text) - len(ending)] for text in written)
            end_of_reply = exchange.split(SENTINEL)[-1]
            # A turn is only ever appended: refused where the template writes the messages before otherwise once a
            # reply or a generation prompt follows (an end of text after the whole conversation, say).
            appended = (
                len(pieces) == 4
                and pieces[2].startswith(end_of_reply)
                and with_turn.startswith(history)
                and longer.startswith(history)
                and not (ending and with_turn.endswith(ending))
            )
            if appended:
                spacing = pieces[1][len(pieces[3]) :]  # between the first message and its reply, past the prompt
                before_reply = spacing if pieces[1].startswith(pieces[3]) and not spacing.strip(" ") else ""
                return cls(pieces[2][len(end_of_reply) :], pieces[3], end_of_reply, before_reply)
        raise ValueError(
            "The tokenizer's chat template does not write a conversation as a sequence of turns; it cannot "
            "be used with compressed memory."
        )
