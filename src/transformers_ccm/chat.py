"""A conversation whose history lives in compressed memory: the engine of `ccm chat` and `ccm demo`."""

from __future__ import annotations

import copy
import re
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import Cache, GenerationMixin, LogitsProcessor, LogitsProcessorList
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm.cache import CompressedMemoryCache
from transformers_ccm.chat_template import SENTINEL, TurnFormat, apply_template, render_turns
from transformers_ccm.data import check_position_limit, token_ids
from transformers_ccm.evaluation import kv_bytes_per_token
from transformers_ccm.modeling import CACHE_ARGUMENT, CCMForCausalLM
from transformers_ccm.validation import positive_int

# The copies of each tokenizer that conversations encode with (see `_encoding_tokenizer`), by `split_special_tokens`.
_ENCODING_TOKENIZERS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[bool, PreTrainedTokenizerBase]] = (
    weakref.WeakKeyDictionary()
)
_ENCODING_TOKENIZERS_LOCK = threading.Lock()


def _encoding_tokenizer(tokenizer: PreTrainedTokenizerBase, split_special_tokens: bool) -> PreTrainedTokenizerBase:
    """A copy of `tokenizer` (one per tokenizer and setting, made again once tokens were added to it) that is only ever
    called with `split_special_tokens`. A fast tokenizer reads that setting from a flag it sets on its backend at each
    call: set on the caller's tokenizer, a user's text encoded in one thread turned the special-token strings of every
    other thread encoding with it meanwhile into text (a template's role markers), and another thread's call could unset
    it before the text was encoded (a typed `<|im_end|>` became the control token). The template's text goes through a
    copy that never splits them: through a tokenizer loaded with `split_special_tokens=True`, every role marker was
    written as text (the model read `<|im_start|>` as seven pieces) and replies stopped at the first `<`."""
    with _ENCODING_TOKENIZERS_LOCK:
        copies = _ENCODING_TOKENIZERS.setdefault(tokenizer, {})
        encoding = copies.get(split_special_tokens)
        if encoding is None or len(encoding) != len(tokenizer):
            encoding = copies[split_special_tokens] = copy.deepcopy(tokenizer)
        return encoding


@dataclass
class TurnReport:
    """What one turn produced and what it costs in KV memory."""

    reply: str
    memory_slots: int  # compressed slots held after folding the turn
    memory_bytes: int
    full_context_tokens: int  # tokens a full-context model would hold for the same history
    full_context_bytes: int


class _Conversation:
    """What every conversation shares: the chat template's turn format and a greedy reply that stops where the
    template ends a reply, or where the model writes any of its own end ids (then closed as the template closes it)."""

    def __init__(self, model: CCMForCausalLM, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int) -> None:
        # Checked here, not by generate() at the first turn, after the user has typed a message.
        if not positive_int(max_new_tokens):
            raise ValueError(f"max_new_tokens must be a positive integer (the longest reply), got {max_new_tokens!r}.")
        self.model = model
        self.tokenizer = tokenizer
        # Text and the template's special tokens read as such, and text whose special-token strings stay text.
        self._encoders = {plain: _encoding_tokenizer(tokenizer, plain) for plain in (False, True)}
        self.max_new_tokens = max_new_tokens
        self.format = TurnFormat.of(tokenizer)
        # The template's spacing before a reply's end (Llama 2: " </s>") is no token the model writes: stopping at
        # its first token stopped replies at a bare space token, and ran them on past the real end token.
        end_of_reply = self._ids(self.format.end_of_reply.lstrip() or self.format.end_of_reply)
        if not end_of_reply:
            raise ValueError("The tokenizer's chat template ends a reply with no token; generation could not stop.")
        self._end_of_turn, self._after_reply = end_of_reply[0], end_of_reply[1:]
        # The template's first turn around a message: how it writes one (Llama 3, Gemma: trimmed) is read from it.
        first_turn = render_turns(tokenizer, "u", True).split(SENTINEL)
        self._first_turn = (first_turn[0], first_turn[-1])
        # The special tokens a template's frame holds: read as such, where a message's strings of them are text.
        self._specials = {token.content: token for token in tokenizer.added_tokens_decoder.values() if token.special}
        longest_first = sorted(self._specials, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!): none to match

    def _ids(self, text: str, plain: bool = False) -> list[int]:
        """Token ids of `text`; with `plain`, special-token strings in it are ordinary text."""
        encoded = self._encoders[plain](text, add_special_tokens=False, split_special_tokens=plain)
        return list(encoded["input_ids"])

    def prompt_ids(self, message: str) -> list[int]:
        """The ids of a user turn, up to where the assistant's reply starts."""
        if not message.strip():
            raise ValueError("The message is empty; type something to say.")
        try:  # the tokenizer refuses a lone surrogate with a TypeError that does not say what is wrong
            message.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"The message is not valid Unicode text (U+{ord(message[error.start]):04X} at character "
                f"{error.start}, a lone surrogate: input that was not UTF-8); type it again as UTF-8 text."
            ) from None
        written = self._as_written(message)
        # The model would answer the template's frame alone: characters the tokenizer drops (a BERT-style tokenizer's
        # control and zero-width characters), or a message the template trims to nothing.
        if not self._ids(written, plain=True):
            raise ValueError(
                f"The message {message!r:.60} holds no text this tokenizer reads (it drops every character of it); "
                "type something to say."
            )
        before, after = self.format.before_message, self.format.after_message
        text = before + written + after
        # Encoded as one text, as the template's conversation is: encoded apart, "[INST] " + "Hi" gave a bare space
        # token before "Hi" where the model reads " Hi", and a SentencePiece tokenizer's "▁" came before the text
        # after a special token ("<|im_start|>" + "user\n"), where the whole text has none.
        if self._special_pattern.search(written) is None:
            ids = self._ids(text)
        else:
            # The message's special-token strings stay text, the frame's special tokens are read as such: the text
            # between the last special token before the message and the first one after it is encoded as plain text,
            # including any frame text around the message.
            start, end = self._plain_span(text, len(before), len(text) - len(after))
            ids = self._ids(text[:start]) + self._ids(text[start:end], plain=True) + self._ids(text[end:])
        return ids

    def _as_written(self, message: str) -> str:
        """`message` as the chat template writes it in a user turn (Llama 3 and Gemma trim it, Llama 2 strips it)."""
        prefix, suffix = self._first_turn
        written = apply_template(self.tokenizer, [{"role": "user", "content": message}], True)
        if written.startswith(prefix) and written.endswith(suffix) and len(written) >= len(prefix) + len(suffix):
            return written[len(prefix) : len(written) - len(suffix)]
        return message  # a template that writes the turn around this message otherwise: the message as typed

    def _plain_span(self, text: str, message_start: int, message_end: int) -> tuple[int, int]:
        """The span of `text` to encode as plain text: from the end of the last special token that starts before
        `message_start` to the start of the first one at or after `message_end`, each widened over the whitespace
        such a token strips on that side (Phi-3's `rstrip`), as the tokenizer reads the whole text."""
        start, end = 0, len(text)
        for match in self._special_pattern.finditer(text, 0, message_start):
            start = match.end()
            if self._specials[match.group()].rstrip:
                start = len(text) - len(text[start:].lstrip())
        match = self._special_pattern.search(text, message_end)
        if match is not None:
            end = match.start()
            if self._specials[match.group()].lstrip:
                end = len(text[:end].rstrip())
        return start, max(start, end)

    def _reply(
        self, input_ids: list[int], model: GenerationMixin, cache: Cache | None
    ) -> tuple[list[int], list[int], list[int]]:
        """`model`'s greedy reply to `input_ids` after what `cache` holds: (every generated id, the reply's ids,
        the ids that close the turn as the template writes it but were not generated)."""
        # A token added to the tokenizer without resizing the model's embeddings failed inside the embedding (for
        # FullContextChat an IndexError; on a GPU, a device-side assert).
        where = "This turn (the message in the chat template's frame)"
        token_ids(input_ids, None, where, vocabulary=self.model.vocabulary_size)
        output = model.generate(
            torch.tensor([input_ids], device=self.model.device),
            **{CACHE_ARGUMENT: cache},
            max_new_tokens=self.max_new_tokens,
            # Greedy whatever the model's generation_config says: with several returned sequences, generate() leaves
            # the memory without the turn, and only the closing tokens would be folded.
            do_sample=False,
            num_beams=1,
            num_return_sequences=1,
            # Nor another decoding mode: assisted generation crops the drafts it rejects from the cache, which a
            # compressed memory cannot take (greedy replies are the same without it); contrastive search and DoLa
            # need remote code; token healing rewrites the end of the template's prompt.
            prompt_lookup_num_tokens=None,
            assistant_early_exit=None,
            penalty_alpha=None,
            dola_layers=None,
            token_healing=False,
            eos_token_id=self._end_of_turn,
            pad_token_id=self._end_of_turn,
            logits_processor=self._ending_at_model_ends(),
            # What the generation_config may ask for and a turn must then supply: the ids alone, a tokenizer to
            # find its stop strings with.
            return_dict_in_generate=False,
            tokenizer=self.tokenizer,
        )
        generated = output[0, len(input_ids) :].tolist()
        if self._end_of_turn in generated:
            return generated, generated[: generated.index(self._end_of_turn)], self._after_reply
        return generated, generated, [self._end_of_turn, *self._after_reply]

    def _ending_at_model_ends(self) -> LogitsProcessorList:
        """Where the model ends its text with another of its end ids (generation_config's list: Llama 3's
        `<|end_of_text|>` beside `<|eot_id|>`, Qwen2.5's `<|endoftext|>` beside `<|im_end|>`), the template's end of
        turn in its place: the reply stops there, and the turn is closed as the template closes it (with the end id
        itself, the memory would hold a closing the template never writes)."""
        ends = self.model.generation_config.eos_token_id
        ends = [ends] if isinstance(ends, int) else list(ends or [])
        # Ids past the vocabulary are none the model can write (and would fail the indexing).
        others = [end for end in ends if end != self._end_of_turn and 0 <= end < self.model.vocabulary_size]
        return LogitsProcessorList([_EndsAsEndOfTurn(self._end_of_turn, others)] if others else [])

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


class _EndsAsEndOfTurn(LogitsProcessor):
    """Gives `end_of_turn` the highest score of itself and `others` (end ids), and the others none: a greedy step
    that would write any of them writes `end_of_turn`, and every other step is unchanged."""

    def __init__(self, end_of_turn: int, others: list[int]) -> None:
        self.end_of_turn, self.others = end_of_turn, others

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`scores` `(batch, vocabulary)`, the next token's, changed as above (a copy)."""
        scores = scores.clone()
        scores[:, self.end_of_turn] = scores[:, [self.end_of_turn, *self.others]].amax(dim=-1)
        scores[:, self.others] = -float("inf")
        return scores


class ChatSession(_Conversation):
    """One user's conversation, written with the tokenizer's chat template. Each turn attends to the memory
    only, then is folded into it (the `<COMP>` block runs; the turn is not re-encoded).

    What the user types is text: special-token strings in it (such as `<|im_end|>`) stay plain text and never
    become role markers.
    """

    def __init__(
        self,
        model: CCMForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        cache: CompressedMemoryCache | None = None,
        max_new_tokens: int = 96,
    ) -> None:
        super().__init__(model, tokenizer, max_new_tokens)
        if cache is not None:
            _check_conversation_memory(model, cache)
        self.cache = cache if cache is not None else model.new_cache()

    @property
    def history_tokens(self) -> int:
        """The tokens a full-context model would hold for the conversation so far, read from the memory: a session
        given a memory loaded from a file counted from 0 again."""
        return int(self.cache.history_tokens[0])

    def turn(self, message: str) -> TurnReport:
        """Answer `message`, fold the exchange into memory, and report the memory held."""
        prompt = self.prompt_ids(message)
        # One step: a failure while folding must not leave the reply in the cache as an unfolded turn, nor one while
        # reporting (an interrupt, say) a folded exchange whose reply the caller never got.
        with self.cache.transaction():
            _, reply_ids, closing = self._reply(prompt, self.model, self.cache)
            # c(t+1) is this turn as the template closes it (for ChatML: "...<|im_end|>\n").
            self.model.compress(self.cache, torch.tensor([closing], device=self.model.device) if closing else None)
            report = TurnReport(
                reply=self._text(reply_ids),
                memory_slots=int(self.cache.memory_mask[0].sum()),
                memory_bytes=self.cache.memory_bytes(),
                full_context_tokens=self.history_tokens,
                full_context_bytes=self.history_tokens * kv_bytes_per_token(self.model),
            )
        return report


def _check_conversation_memory(model: CCMForCausalLM, cache: CompressedMemoryCache) -> None:
    """Raise, before any message is typed, unless `cache` can hold one conversation with `model`: every turn of a
    session failed on another kind of cache, a memory of another model or adapter, a stream, a memory of several
    users, or one with a turn left unfolded."""
    model._check_cache(cache, "ChatSession")  # the cache's kind, owner and device, as every model call checks them
    problem = (
        "a streaming cache, which compresses by itself"
        if cache.streaming is not None
        else f"a memory of {cache.batch_size} users"
        if cache.batch_size != 1
        else "a memory whose last turn is not folded (call model.compress(cache) first)"
        if cache.has_unfolded_turn
        else None
    )
    if problem is not None:
        raise ValueError(
            f"ChatSession needs one user's memory; this is {problem}; start from model.new_cache() (ccm chat: "
            "another --memory-file)."
        )


class FullContextChat(_Conversation):
    """The same conversation with the whole history as its prompt: what compressed memory is compared against.
    The base model alone for a compression adapter; with its LoRA for the fine-tuned full-context baseline
    (`CCMForCausalLM.reading_plain_prompt`). Its KV grows with every token."""

    def __init__(self, model: CCMForCausalLM, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int = 96) -> None:
        super().__init__(model, tokenizer, max_new_tokens)
        self.history: list[int] = []
        self._answering = threading.Lock()

    @property
    def history_tokens(self) -> int:
        return len(self.history)

    def turn(self, message: str) -> str:
        """Answer `message` from the whole conversation so far and keep the exchange in it."""
        # Two turns at once each read the same history, and the one that ended last kept only its own exchange.
        if not self._answering.acquire(blocking=False):
            raise ValueError(
                "This FullContextChat is answering another message (in another thread, or from inside its turn); a "
                "conversation takes one message at a time: wait for the reply, or give each user their own."
            )
        try:
            return self._turn(message)
        finally:
            self._answering.release()

    def _turn(self, message: str) -> str:
        prompt = self.history + self.prompt_ids(message)
        # Learned absolute positions (GPT-2) failed inside the position embedding (on a GPU, a device-side assert);
        # generate() runs the prompt and every generated token but the last.
        check_position_limit(
            len(prompt) + self.max_new_tokens - 1,
            self.model.absolute_position_limit,
            f"The conversation with this message and a reply of up to {self.max_new_tokens} tokens",
        )
        with self.model.reading_plain_prompt():
            generated, reply_ids, closing = self._reply(prompt, self.model.base_model, None)
        # Decoded before the exchange joins the history: a failure while decoding (an interrupt, the tokenizer's own
        # error) kept an exchange whose reply the caller never got, as ChatSession.turn keeps none.
        reply = self._text(reply_ids)
        self.history = prompt + generated + closing
        return reply
