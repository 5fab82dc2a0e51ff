"""Tiny random configurations of real architectures, adapters with random (non-zero) weights, and the helpers that
make their calls fail or sample reproducibly."""

from __future__ import annotations

import functools

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTJConfig,
    GPTNeoXConfig,
    GptOssConfig,
    LlamaConfig,
    LogitsProcessor,
    MistralConfig,
    MixtralConfig,
    OlmoConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm import CCMConfig, CCMForCausalLM
from transformers_ccm.baseline import full_context_config
from transformers_ccm.lora import lora_layers

VOCAB = 97
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _configs() -> dict[str, PretrainedConfig]:
    return {
        "llama": LlamaConfig(**_COMMON),
        "llama-eager": LlamaConfig(**_COMMON, attn_implementation="eager"),
        "mistral": MistralConfig(**_COMMON, sliding_window=None),
        "mixtral": MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen2": Qwen2Config(**_COMMON),
        "qwen3": Qwen3Config(**_COMMON, head_dim=8),
        "gemma2": Gemma2Config(**_COMMON, head_dim=8, attn_implementation="eager"),
        "gemma3": Gemma3TextConfig(**_COMMON, head_dim=8),
        "phi3": Phi3Config(**_COMMON),
        "gpt-neox": GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            rotary_pct=0.5,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "olmo": OlmoConfig(**_COMMON),
        # Rotary embeddings that streaming cannot move: interleaved pairs; a layer without positions (NoPE); a table.
        "cohere": CohereConfig(**_COMMON),
        "smollm3": SmolLM3Config(**_COMMON, no_rope_layer_interval=2),
        "gptj": GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=512),
        # Attention sinks (a softmax logit per head), eager attention only; mixture-of-experts.
        "gpt-oss": GptOssConfig(**_COMMON, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
        "gpt2": GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2
        ),
    }


ARCHITECTURES = tuple(_configs())


def _more_configs() -> dict[str, PretrainedConfig]:
    """Tiny configs of more architectures CCM runs exactly, by transformers' model type (one test each)."""
    rotary_at = dict(_COMMON, head_dim=8)
    without_groups = {key: value for key, value in _COMMON.items() if key != "num_key_value_heads"}
    classic = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2)
    configs = {
        "qwen3_moe": dict(rotary_at, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        "qwen2_moe": dict(
            _COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
        ),
        "gemma": rotary_at,
        "cohere2": _COMMON,
        "opt": dict(without_groups, ffn_dim=64, word_embed_proj_dim=32),
        "phi": dict(_COMMON, partial_rotary_factor=0.5),
        "starcoder2": _COMMON,
        "olmo2": _COMMON,
        "olmo3": _COMMON,
        "granite": dict(_COMMON, attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5),
        "granitemoe": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2),
        "gpt_bigcode": classic,
        "codegen": dict(classic, rotary_dim=4, n_ctx=512),
        "glm": rotary_at,
        "glm4": rotary_at,
        "helium": rotary_at,
        "exaone4": _COMMON,
        "persimmon": without_groups,
    }
    return {name: AutoConfig.for_model(name, **settings) for name, settings in configs.items()}


MORE_ARCHITECTURES = tuple(_more_configs())


def more_tiny_base(model_type: str, seed: int = 0, **settings: object) -> PreTrainedModel:
    """A tiny random model of one of `MORE_ARCHITECTURES`, its config changed by `settings`."""
    torch.manual_seed(seed)
    config = _more_configs()[model_type]
    config.update(settings)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_base(architecture: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = _configs()[architecture]
    implementation = config._attn_implementation if architecture in ("llama-eager", "gemma2") else "sdpa"
    implementation = "eager" if architecture == "gpt-oss" else implementation
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


def tiny_longrope_base(seed: int = 0) -> PreTrainedModel:
    """A tiny random Phi-3 with LongRoPE (as Phi-3.5-mini): its rotary frequencies are scaled, in place, at each
    forward that reaches past position 64."""
    torch.manual_seed(seed)
    half = 32 // 4 // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * half,
        "long_factor": [4.0] * half,
        "original_max_position_embeddings": 64,
    }
    config = Phi3Config(**_COMMON, original_max_position_embeddings=64, rope_parameters=rope)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def tiny_dynamic_ntk_base(seed: int = 0) -> PreTrainedModel:
    """A tiny random Llama with dynamic NTK scaling: its rotary frequencies are rescaled, in place, at each forward that
    reaches past position 64 (its `max_position_embeddings`)."""
    torch.manual_seed(seed)
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = LlamaConfig(**{**_COMMON, "max_position_embeddings": 64}, rope_parameters=rope)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def tiny_wide_head_base(seed: int = 0) -> PreTrainedModel:
    """A tiny random Llama with SmolLM2's head size (64) and rotary base (100000): most of its rotary frequencies move
    a key by less than a bfloat16 rounding step per position."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        **{**_COMMON, "hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1},
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def tiny_llama_for(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> PreTrainedModel:
    """A tiny random Llama with `tokenizer`'s vocabulary and special tokens, for tests that need real text."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def confident_tiny_llama(seed: int = 0) -> PreTrainedModel:
    """A tiny random Llama for learning tests: initializer_range 0.2 gives the frozen base logits wide enough to
    express a confident answer."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.2,
            tie_word_embeddings=True,
        )
    )


def randomize_adapter(model: CCMForCausalLM, seed: int = 1) -> CCMForCausalLM:
    """Give every LoRA matrix and the <COMP> embeddings random, clearly non-zero values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model.base_model):
            for module in (*layer.lora_A.values(), *layer.lora_B.values()):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.3)
        model.comp_embeddings.copy_(torch.randn(model.comp_embeddings.shape, generator=generator))
    return model.eval()


@functools.cache
def tiny_ccm(architecture: str, **config: object) -> CCMForCausalLM:
    """A cached tiny CCM model with a random adapter (tests must not modify it)."""
    return randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig(**config)))


def tiny_full_context_baseline(architecture: str = "llama", seed: int | None = None) -> CCMForCausalLM:
    """A tiny fine-tuned full-context baseline (a LoRA at every position) on `tiny_base(architecture)`: random LoRA
    drawn with `seed`, or with `seed=None` the LoRA still zero (it reads a plain prompt as the base model does)."""
    model = CCMForCausalLM.from_base(tiny_base(architecture), full_context_config(CCMConfig(lora_dropout=0.0)))
    return model.eval() if seed is None else randomize_adapter(model, seed=seed)


class SeededSampling(LogitsProcessor):
    """Sampling from the model's distribution with a generator of the call's own (Gumbel-max): every token but the
    drawn one is masked, so generate()'s own draw from the global generator, which threads share, picks it surely."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        uniform = torch.rand(scores.shape, generator=self.generator).clamp_(min=1e-20)
        drawn = (scores - torch.log(-torch.log(uniform))).argmax(-1, keepdim=True)
        return torch.full_like(scores, -torch.inf).scatter(-1, drawn, 0.0)


class InjectedFailure(RuntimeError):
    """The failure `fail_in_layer` injects."""


def fail_in_layer(model: CCMForCausalLM, layer: int, after_calls: int) -> torch.utils.hooks.RemovableHandle:
    """Make decoder layer `layer` raise on its `after_calls`-th call (an injected fault, as an OOM would)."""
    block = model.base_model.model.layers[layer]
    count = [0]

    def hook(*_: object) -> None:
        count[0] += 1
        if count[0] > after_calls:
            raise InjectedFailure("injected failure")

    return block.register_forward_pre_hook(hook)


def wordpiece_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A tiny BERT-style WordPiece tokenizer (it drops control and zero-width characters), built here: words `hello`,
    `world`, `user`, `assistant` and `[END]`, a special token, with `chat_template`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    words = ["[UNK]", "[PAD]", "[END]", "hello", "world", "user", "assistant", ":", "##s"]
    backend = Tokenizer(models.WordPiece({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.add_special_tokens({"additional_special_tokens": ["[END]"]})
    tokenizer.chat_template = chat_template
    return tokenizer


def sentencepiece_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-style BPE tokenizer (Mistral v0.3's kind: spaces as "▁", one before the text's first word
    but none after a special token), trained here on a few sentences; `<s>`, `</s>`, `[INST]`, `[/INST]` and ChatML's
    markers as special tokens; with `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<|im_start|>", "<|im_end|>"]
    corpus = ["Hello there, my friend! What is my name? I am fine.\nuser assistant"] * 20
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials[3:]})
    tokenizer.chat_template = chat_template
    return tokenizer
