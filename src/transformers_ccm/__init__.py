"""Compressed Context Memory (CCM) for Hugging Face transformers."""

__version__ = "0.1.0"

from transformers_ccm.cache import CompressedMemoryCache
from transformers_ccm.config import CCMConfig
from transformers_ccm.data import CCMDataCollator, OnlineSample
from transformers_ccm.modeling import CCMForCausalLM
from transformers_ccm.streaming import StreamingConfig

__all__ = [
    "CCMConfig",
    "CCMDataCollator",
    "CCMForCausalLM",
    "CompressedMemoryCache",
    "OnlineSample",
    "StreamingConfig",
    "__version__",
]
