"""A conversation whose history lives in compressed memory: the engine of `ccm chat` and `ccm demo`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm.cache import CompressedMemoryCache
from transformers_ccm.evaluation import kv_bytes_per_token
from transformers_ccm.modeling import CCMForCausalLM

END_OF_TURN = "<|im_end|>"


@dataclass
class TurnReport:
    """What one turn produced and what it costs in KV memory."""

    reply: str
    memory_slots: int  # compressed slots held after folding the turn
    memory_bytes: int
    full_context_tokens: int  # tokens a full-context model would hold for the same history
    full_context_bytes: int


class ChatSession:
    """One user's conversation in ChatML. Each turn attends to the memory only, then is folded into it
    (the `<COMP>` block runs; the turn is not re-encoded)."""

    def __init__(
        self,
        model: CCMForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        cache: CompressedMemoryCache | None = None,
        max_new_tokens: int = 96,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache if cache is not None else model.new_cache()
        self.max_new_tokens = max_new_tokens
        self.history_tokens = 0
        self._end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self._newline = tokenizer("\n", add_special_tokens=False)["input_ids"]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def turn(self, message: str) -> TurnReport:
        """Answer `message`, fold the exchange into memory, and report the memory held."""
        if not message.strip():
            raise ValueError("The message is empty; type something to say.")
        prompt = self._ids(f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n")
        output = self.model.generate(
            torch.tensor([prompt], device=self.model.device),
            past_key_values=self.cache,
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            eos_token_id=self._end_of_turn,
            pad_token_id=self._end_of_turn,
        )
        generated = output[0, len(prompt) :].tolist()
        reply_ids = generated[: generated.index(self._end_of_turn)] if self._end_of_turn in generated else generated
        # c(t+1) = this turn as the training dialogues write it: "...<|im_end|>\n"
        self.model.compress(self.cache, torch.tensor([self._newline], device=self.model.device))
        self.history_tokens += len(prompt) + len(generated) + len(self._newline)
        per_token = kv_bytes_per_token(self.model)
        return TurnReport(
            reply=self.tokenizer.decode(reply_ids, skip_special_tokens=True).strip(),
            memory_slots=int(self.cache.memory_mask[0].sum()),
            memory_bytes=self.cache.memory_bytes(),
            full_context_tokens=self.history_tokens,
            full_context_bytes=self.history_tokens * per_token,
        )
