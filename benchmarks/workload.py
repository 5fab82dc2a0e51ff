"""What the benchmarks run: the models, a fixed-length workload, online turns and KV accounting.

Timing and memory depend on token counts only, so the tokens are random ids (never special tokens), the
same for every method. A time step brings a context of 50 tokens (the paper's MetaICL/LaMP average, its
Table 16) or, in a dialogue, the previous turn. A turn then answers a 16-token input with 16 new tokens.
Histories are built for one user and repeated for a batch: every row costs the same.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache

from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache
from transformers_ccm.embedded import DEFAULT_MODEL, load_base_model, resolve_name
from transformers_ccm.evaluation import kv_bytes_per_token
from transformers_ccm.modeling import CACHE_ARGUMENT, passed_cache

TurnKind = Literal["context", "dialogue"]
NO_CONTEXT = "no context"
FULL_CONTEXT = "full context"
SHIPPED_ADAPTERS = ("ccm:smollm2-concat", "ccm:smollm2-merge")
PAPER_CONTEXT_TOKENS = 50  # the paper's average context on MetaICL and LaMP (its Table 16)


@dataclass(frozen=True)
class Workload:
    """Token lengths of one time step and one turn."""

    context_tokens: int = PAPER_CONTEXT_TOKENS
    input_tokens: int = 16
    new_tokens: int = 16
    seed: int = 0

    def step_tokens(self, kind: TurnKind) -> int:
        """Tokens one time step adds to the history: a context, or a whole turn (input and output)."""
        return self.context_tokens if kind == "context" else self.input_tokens + self.new_tokens

    def tokens(self, vocab_size: int, length: int, salt: int) -> torch.Tensor:
        """`(1, length)` random ids from the upper three quarters of the vocabulary."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
        return torch.randint(vocab_size // 4, vocab_size, (1, length), generator=generator)

    def step(self, vocab_size: int, kind: TurnKind, step: int) -> torch.Tensor:
        """`(1, step_tokens)` the tokens of time step `step` (1-based)."""
        return self.tokens(vocab_size, self.step_tokens(kind), salt=step)

    def history(self, vocab_size: int, kind: TurnKind, steps: int) -> torch.Tensor:
        """`(1, steps * step_tokens)` the tokens of time steps 1..steps."""
        parts = [self.step(vocab_size, kind, step) for step in range(1, steps + 1)]
        return torch.cat(parts, dim=1) if parts else torch.zeros(1, 0, dtype=torch.long)

    def prompt(self, vocab_size: int) -> torch.Tensor:
        """`(1, input_tokens)` the input of a turn."""
        return self.tokens(vocab_size, self.input_tokens, salt=0)

    def generation(self, model: PreTrainedModel) -> dict[str, Any]:
        """`generate()` arguments: greedy, exactly `new_tokens` new tokens."""
        config = model.generation_config
        eos = config.eos_token_id
        pad = config.pad_token_id if config.pad_token_id is not None else eos[0] if isinstance(eos, list) else eos
        return {
            "max_new_tokens": self.new_tokens,
            "min_new_tokens": self.new_tokens,
            "do_sample": False,
            "pad_token_id": 0 if pad is None else pad,
        }


@dataclass
class Subject:
    """The models measured: `base` runs no context and full context; `ccm` holds the CCM models by method."""

    name: str
    base: PreTrainedModel
    ccm: dict[str, CCMForCausalLM]

    @property
    def vocab_size(self) -> int:
        return self.base.get_input_embeddings().num_embeddings

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token or memory slot over all layers."""
        return kv_bytes_per_token(next(iter(self.ccm.values())))

    def modules(self) -> list[nn.Module]:
        """Every module that receives the cache argument."""
        return [self.base, *(model.base_model for model in self.ccm.values())]


def load_subject(model: str, adapters: Sequence[str] | None = None) -> Subject:
    """The base model and its CCM models: `adapters` loaded with `CCMForCausalLM.from_pretrained` (for the
    default model, the shipped ones), or else fresh concat and merge adapters (timing and memory do not depend on
    trained weights). `model` is "default", a path or Hub id, or a `config.json` (random weights)."""

    def new_base() -> PreTrainedModel:
        if model.endswith(".json"):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        return load_base_model(model)

    if adapters is None and model == DEFAULT_MODEL:
        adapters = SHIPPED_ADAPTERS
    if adapters:
        models = [CCMForCausalLM.from_pretrained(adapter, base_model=new_base()) for adapter in adapters]
    else:
        models = [CCMForCausalLM.from_base(new_base(), CCMConfig(update=update)) for update in ("concat", "merge")]
    ccm = {f"ccm-{m.config.update}": m.eval() for m in models}
    if len(ccm) != len(models):
        raise ValueError(f"Give adapters with different update rules, got {[m.config.update for m in models]}.")
    return Subject(os.path.basename(model) if model.endswith(".json") else resolve_name(model), new_base().eval(), ccm)


def llama_7b_config() -> LlamaConfig:
    """The sizes of LLaMA-7B, the paper's model for Tables 1 and 16."""
    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=2048,
    )


def meta_model(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """A model built from its config on the meta device: shapes only, no weights, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# ----- KV accounting ------------------------------------------------------------------------------------------
def cache_bytes(cache: Cache) -> int:
    """Bytes of all keys and values a cache holds, over all layers, measured from its tensors."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


class PeakKV:
    """Within the context, the most KV bytes a cache held at the end of any forward of `modules`."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = list(modules)
        self.bytes = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> PeakKV:
        self._handles = [m.register_forward_hook(self._record, with_kwargs=True) for m in self.modules]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        cache = passed_cache(kwargs)
        if cache is not None:
            self.bytes = max(self.bytes, cache_bytes(cache))


# ----- online turns -------------------------------------------------------------------------------------------
@dataclass
class States:
    """Each method's state at the start of some time steps, for one user.

    kind "context": steps 1..t-1 brought contexts (in the cache: their tokens, or their compression).
    kind "dialogue": steps 1..t-1 were turns; CCM has folded all but the last, which `generate()` left in the
    cache (the turn at t folds it, running only the `<COMP>` block).
    """

    kind: TurnKind
    full_context: dict[int, DynamicCache] = field(default_factory=dict)
    ccm: dict[str, dict[int, CompressedMemoryCache]] = field(default_factory=dict)


@torch.no_grad()
def build_states(subject: Subject, workload: Workload, steps: Sequence[int], kind: TurnKind) -> States:
    """The states at the start of each of `steps`, built incrementally."""
    vocab, steps = subject.vocab_size, sorted(steps)
    states = States(kind)
    cache = DynamicCache(config=subject.base.config)
    for step in steps:
        missing = workload.history(vocab, kind, step - 1)[:, cache.get_seq_length() :]
        if missing.shape[1]:
            subject.base(input_ids=missing, use_cache=True, logits_to_keep=1, **{CACHE_ARGUMENT: cache})
        states.full_context[step] = copy.deepcopy(cache)
    generation = workload.generation(subject.base)
    for name, model in subject.ccm.items():
        memory, compressed, states.ccm[name] = model.new_cache(1), 0, {}
        for step in steps:
            target = step - 1 if kind == "context" else max(step - 2, 0)
            for done in range(compressed + 1, target + 1):
                model.compress(memory, workload.step(vocab, kind, done))
            compressed = target
            state = memory.copy()
            if kind == "dialogue" and step >= 2:
                model.generate(workload.prompt(vocab), past_key_values=state, **generation)
            states.ccm[name][step] = state
    return states


def turn_cases(
    subject: Subject,
    workload: Workload,
    states: States,
    step: int,
    batch: int,
    methods: Collection[str] | None = None,
) -> dict[str, Callable[[], object]]:
    """One turn at time step `step` for `batch` users, per method (all, or `methods`); every call starts from
    the same state.

    A turn takes in the step (kind "context": compress or append a new context; "dialogue": fold the last
    turn, which full context already holds), then generates `new_tokens` for the input.
    """
    methods = [NO_CONTEXT, FULL_CONTEXT, *subject.ccm] if methods is None else methods
    vocab, generation = subject.vocab_size, workload.generation(subject.base)
    prompt = workload.prompt(vocab).repeat(batch, 1)
    context = workload.step(vocab, "context", step).repeat(batch, 1) if states.kind == "context" else None
    base = subject.base

    def no_context() -> None:
        base.generate(prompt, attention_mask=torch.ones_like(prompt), **generation)

    def full_context() -> Callable[[], None]:
        cache = copy.deepcopy(states.full_context[step])
        cache.batch_repeat_interleave(batch)
        history = cache.get_seq_length()
        new = prompt if context is None else torch.cat([context, prompt], dim=1)
        ids = torch.cat([workload.history(vocab, states.kind, step - 1).repeat(batch, 1), new], dim=1)

        def turn() -> None:
            base.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE_ARGUMENT: cache}, **generation)
            cache.crop(history - cache.get_seq_length())

        return turn

    cases: dict[str, Callable[[], object]] = {}
    for name in methods:
        if name == NO_CONTEXT:
            cases[name] = no_context
        elif name == FULL_CONTEXT:
            cases[name] = full_context()
        else:
            cases[name] = _ccm_turn(subject.ccm[name], states.ccm[name][step], batch, context, prompt, generation)
    return cases


def _ccm_turn(
    model: CCMForCausalLM,
    state: CompressedMemoryCache,
    batch: int,
    context: torch.Tensor | None,
    prompt: torch.Tensor,
    generation: dict[str, Any],
) -> Callable[[], None]:
    state = state.copy()
    state.batch_repeat_interleave(batch)

    def turn() -> None:
        cache = state.copy()
        if context is not None:
            model.compress(cache, context)
        elif cache.has_unfolded_turn:
            model.compress(cache)
        model.generate(prompt, past_key_values=cache, **generation)

    return turn
