"""Identities of weights: what a compressed memory records so that only the model that made it accepts it.

`adapter_digest` hashes every adapter tensor by name, whatever its `requires_grad`. `weights_fingerprint`
covers every element of every base weight with two exact integer sums over the raw bits (the same on any
device and in any reduction order), without the cost of a cryptographic hash of gigabytes. `computing_settings`
picks the entries of a base model's config that change what it computes with those weights (rotary base and
scaling, norm epsilon, sliding window, ...).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from transformers import PretrainedConfig

_CHUNK = 1 << 22
_ROW = 64
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Row weights of the second sum (a prime modulus keeps the products far from int64 overflow).
_MODULUS = 65521
# Entries of a model config that change nothing a model computes in eval mode: those every transformers config has
# (names, versions, output switches), and the initialisation, caching and tying switches that model configs add.
_BOOKKEEPING = frozenset(PretrainedConfig().to_dict()) | {
    "transformers_version",
    "use_cache",
    "initializer_range",
    "tie_word_embeddings",
}


def computing_settings(config: PretrainedConfig) -> dict[str, Any]:
    """The entries of `config` that may change the keys/values the model computes, as JSON reads them back: every
    entry but bookkeeping (`_BOOKKEEPING`), private ones, token ids (`pad_token_id`, ...: the tokenizer's) and
    dropout rates (off in eval)."""
    settings = {
        key: value
        for key, value in config.to_dict().items()
        if key not in _BOOKKEEPING
        and not key.startswith("_")
        and not key.endswith("_token_id")
        and "dropout" not in key
        and not key.endswith("pdrop")
    }
    return comparable_settings(json.loads(json.dumps(settings)))  # tuples as lists, as a memory file's header has them


def comparable_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` (`computing_settings`, or those a memory file records) less the `quantization_config` that names the
    GGUF file a model was read from: the same weights, read from the GGUF file or from a copy in transformers' format
    (the embedded model's two ways), compute the same, and weights packed in GGUF blocks are told apart by their
    fingerprint. A memory of the one was refused by the other, and every memory made with the default model before
    its copy was kept (its header names the GGUF file) by the model read from the copy."""
    found = settings.get("quantization_config")
    if isinstance(found, dict) and found.get("quant_method") == "gguf":
        return {key: value for key, value in settings.items() if key != "quantization_config"}
    return settings


def adapter_digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of named tensors, in the order given, over their names and exact bytes."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_fingerprint(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over each named tensor's name, shape, dtype and two integer sums of its raw bits: their plain
    sum and their sum weighted by position (which tells permutations apart). Tensors on the meta device (not
    loaded) count by name, shape and dtype only."""
    digest = hashlib.sha256()
    sums = []
    for name, tensor in tensors:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if tensor.device.type != "meta" and tensor.numel():
            sums.append(_bit_sums(tensor.detach()))
    if sums:
        digest.update(torch.stack(sums).cpu().numpy().tobytes())
    return digest.hexdigest()


def _bit_sums(tensor: torch.Tensor) -> torch.Tensor:
    """`(2,)` int64: the sum of the tensor's raw bits read as integers, and the sum of its rows of `_ROW`
    elements weighted by the row's index (which tells moved rows apart)."""
    bits = tensor.reshape(-1).contiguous().view(_INTEGER_OF_SIZE[tensor.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK]
        padded = torch.nn.functional.pad(chunk, (0, -chunk.numel() % _ROW)).view(-1, _ROW)
        rows = padded.sum(dim=1, dtype=torch.int64)
        index = torch.arange(start // _ROW, start // _ROW + rows.numel(), device=tensor.device) % _MODULUS + 1
        total += torch.stack([rows.sum(), (rows * index).sum()])
    return total
