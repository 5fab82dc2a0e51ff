"""The memory file: what `CompressedMemoryCache.save` writes and `CompressedMemoryCache.load` reads.

A safetensors file whose one metadata entry (`MEMORY_FORMAT`) holds a JSON header: the format version, the
signature of the model and adapter that made the memory, and a stream's config and lengths. Its tensors are the
rows' bookkeeping (`memory_mask`, `next_position`, `steps`, ...) and each layer's held keys/values.

A file is checked whole before any cache is built: the header and every tensor's name, dtype and shape before any
data is read (a crafted file cannot make the reader allocate more than the memory it declares), then the values.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import reprlib
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from transformers_ccm.files import not_enough_memory, raise_if_short_of, replace_file
from transformers_ccm.identity import comparable_settings
from transformers_ccm.json_reading import parse_json_object
from transformers_ccm.safetensors_header import DeclaredTensor, safetensors_header, write_errors_as_os_errors
from transformers_ccm.streaming import CapAboveAdapterError, StreamingConfig
from transformers_ccm.validation import is_int

if TYPE_CHECKING:
    from transformers_ccm.cache import CacheSpec

logger = logging.getLogger(__name__)

MEMORY_FORMAT = "transformers-ccm-memory"
MEMORY_FORMAT_VERSION = "3"
# The most tokens a row may take in (`history_tokens`): far beyond any real history, and bounded (a file is refused
# past it, a turn that would pass it too) so that the count never overflows int64 and every saved memory loads.
MOST_HISTORY_TOKENS = 2**62
# The most folds a row counts (`steps`): a file is refused past it, and a fold there leaves the count as it is (merge:
# its 1/t is then 0 to float precision anyway), so that the count never overflows int64 and every saved memory loads.
MOST_FOLDS = 2**62
# The signature fields that files of older format versions did not record: version 1 identified neither the base
# weights nor, as version 2, the LoRA scaling, the gate and the base config. Such a file is checked on the rest.
_UNRECORDED = {
    "1": ("base_fingerprint", "lora_scaling", "conditional_lora", "base_config"),
    "2": ("lora_scaling", "conditional_lora", "base_config"),
}


def write_memory_file(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
    """Write `tensors` and `header` (the signature, a stream's config and lengths) to `path` as a memory file of the
    current format version, replacing it whole (a failed write keeps the earlier file)."""
    # One metadata entry: safetensors writes several in no fixed order, and equal memories must be equal files.
    metadata = {MEMORY_FORMAT: json.dumps({"format_version": MEMORY_FORMAT_VERSION, **header}, sort_keys=True)}
    tensors = {name: tensor.contiguous().cpu() for name, tensor in tensors.items()}

    def write(temporary: str) -> None:
        with write_errors_as_os_errors():
            save_file(tensors, temporary, metadata)

    replace_file(path, write)


def read_memory_file(path: str | os.PathLike[str], spec: CacheSpec) -> MemoryFile:
    """The checked content of the memory file at `path`, written for the model `spec` describes. Any problem raises
    a `ValueError` that names it (`FileNotFoundError` where there is no file)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        # Opened as it is, a named pipe would block for ever and a folder would read as "No such device".
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise ValueError(f"{path} is {kind}, not a memory file; give the file that cache.save() wrote.")
    try:
        # Unbuffered: a buffered file read again from its start gave the bytes it had buffered (its first 8 KiB, the
        # header among them) and the rest from the disk, so a file written over meanwhile loaded as a mix of two.
        with open(path, "rb", buffering=0) as file:
            # The header first (signature, names, dtypes, shapes): a file of another model, or one that declares
            # tensors of any other size, is refused before any of its data is read or mapped.
            metadata, declared, spans, header = safetensors_header(
                file, f"{path} is not a readable safetensors memory file", "save the memory again."
            )
            content = MemoryFile(path, metadata, declared, spec)
            _check_spans(declared, spans, path)
            file.seek(0)
            data = file.read()
            # Written in place since its header was checked (another model's memory of the same shapes, say): the data
            # read now is not the file whose signature and layout were checked.
            if not data.startswith(header):
                raise ValueError(f"{path} changed while it was read; load it again.")
            tensors = load(data)
    except (FileNotFoundError, NotADirectoryError):  # the latter: a file where the path has a folder
        raise FileNotFoundError(f"No memory file at {path}.") from None
    except MemoryError as error:
        raise not_enough_memory("the memory file", path) from error
    except (SafetensorError, OSError) as error:  # the file's fault; any other error (out of memory) goes up as is
        raise_if_short_of(error, path)
        raise ValueError(f"{path} is not a readable safetensors memory file ({error}).") from None
    content.read(tensors)
    return content


def _check_spans(declared: dict[str, DeclaredTensor], spans: dict[str, tuple[int, int]], path: str) -> None:
    """Raise unless each tensor's data takes the bytes its dtype and shape do (`MemoryFile` has checked both): the
    file is then no larger than the memory it declares, before any of it is read."""
    for name, (dtype, shape) in declared.items():
        start, end = spans[name]
        expected = math.prod(shape) * dtype.itemsize
        if end - start != expected:
            raise ValueError(
                f"{path} is not a readable safetensors memory file (its header gives '{name}' {end - start} bytes of "
                f"data, its dtype and shape take {expected})."
            )


class MemoryFile:
    """The checked content of a memory file, before anything is built: `__init__` checks the header (format,
    signature, the name, dtype and shape of every tensor), `read` the values of the tensors it declares."""

    def __init__(
        self, path: str, metadata: dict[str, str], declared: dict[str, DeclaredTensor], spec: CacheSpec
    ) -> None:
        # The declared tensors until `read` gives their values: every check before it needs only dtypes and shapes.
        self.path, self.tensors, self.spec = path, declared, spec
        header = self._header(metadata)
        version = header.get("format_version")
        # A later version would still be a number written in decimal ("4"): anything else ("3.0", " 3") is damage,
        # which upgrading would not help.
        if not isinstance(version, str) or re.fullmatch(r"[1-9][0-9]*", version) is None:
            raise self._fail(
                f"its format_version is {version!r}, not a version number written as {MEMORY_FORMAT_VERSION!r} is"
            )
        if version not in (*_UNRECORDED, MEMORY_FORMAT_VERSION):
            raise ValueError(
                f"{path} has memory format version {version!r}; this transformers-ccm reads versions "
                f"{[*_UNRECORDED, MEMORY_FORMAT_VERSION]}. Upgrade transformers-ccm."
            )
        signature = header.get("signature")
        if not isinstance(signature, dict):
            raise self._fail("its header has no signature")
        if isinstance(signature.get("base_config"), dict):
            signature = {**signature, "base_config": comparable_settings(signature["base_config"])}
        unrecorded = _UNRECORDED.get(version, ())
        expected = {key: value for key, value in spec.signature.items() if key not in unrecorded}
        differences = signature_differences(signature, expected, "file")
        if differences:
            raise ValueError(f"{path} was made by another model or adapter ({differences}); load it with that model.")
        if unrecorded:
            logger.warning(
                "%s has memory format version %s, which did not record %s, so those could not be checked; it is "
                "accepted because the rest of its signature matches this model. Save it again to write version %s.",
                path,
                version,
                ", ".join(unrecorded),
                MEMORY_FORMAT_VERSION,
            )
        self.streaming, self.stream_state = self._streaming(header.get("streaming"))
        self._check_row_layout()
        self._check_layer_layout()

    def read(self, tensors: dict[str, torch.Tensor]) -> None:
        """Check the values of `tensors`, the file's tensors as `__init__` checked them declared."""
        # The same header as checked (`read_memory_file`), so the tensors are those it declares.
        self.tensors = tensors
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise self._fail(f"'{name}' holds values that are not finite")
        self._check_row_values()
        self._check_layer_values()

    def _fail(self, problem: str) -> ValueError:
        return ValueError(f"{self.path} is not a valid memory file: {problem}. Save the memory again.")

    def _header(self, metadata: dict[str, str]) -> dict[str, Any]:
        """The header as one dict: versions 2 and later keep it in one JSON entry, version 1 in several."""
        if MEMORY_FORMAT in metadata:
            return self._json(metadata[MEMORY_FORMAT], "header")
        if metadata.get("format") != MEMORY_FORMAT:
            raise ValueError(
                f"{self.path} is a safetensors file but not a transformers-ccm memory (no '{MEMORY_FORMAT}')."
            )
        header: dict[str, Any] = {"format_version": metadata.get("format_version")}
        for key in ("signature", "streaming"):
            if key in metadata:
                header[key] = self._json(metadata[key], key)
        return header

    def _json(self, text: str, what: str) -> dict[str, Any]:
        return parse_json_object(text, f"{self.path} is not a valid memory file: its {what}", "save the memory again.")

    def _streaming(self, content: Any) -> tuple[StreamingConfig | None, dict[str, int]]:
        if content is None:
            return None, {}
        try:
            # Files written before StreamingConfig.keep_window_full streamed with the paper's schedule.
            streaming = StreamingConfig(**{"keep_window_full": False, **content["config"]})
            rotary = None if self.spec.rotation is None else self.spec.rotation.max_positions
            streaming.validate(self.spec.config, self.spec.max_positions, rotary)
            streaming = streaming.for_adapter(self.spec.config)
            state = {name: content["state"][name] for name in ("sink_length", "window_length", "turn_tokens")}
            state["compressed_in_window"] = content["state"].get("compressed_in_window", 0)
            if "stream_lengths" in self.tensors:  # rows of different lengths: the longest row's
                state["kv_length"] = content["state"]["kv_length"]
        except CapAboveAdapterError as error:
            # Streams could before they took their adapter's cap: a memory the adapter was not made to read, which no
            # save of it mends.
            raise ValueError(
                f"{self.path} holds a stream whose memory held up to {error.cap} slots, more than its adapter's "
                f"CCMConfig.max_memory_tokens ({error.adapter_cap}), as streams could before they took their adapter's "
                "cap; such a memory is not one the adapter was made to read. Start the stream again (its file is left "
                "as it is)."
            ) from None
        except (KeyError, TypeError, ValueError) as error:
            raise self._fail(f"its streaming header is wrong ({error!r})") from None
        if not all(is_int(value) and value >= 0 for value in state.values()):
            raise self._fail(f"its streaming lengths {state} are not integers >= 0")
        if (
            state["sink_length"] > streaming.sink_tokens
            or state["window_length"] > streaming.window_tokens
            or state["compressed_in_window"] > state["window_length"]
        ):
            raise self._fail(f"its streaming lengths {state} exceed the sizes {asdict(streaming)}")
        mask = self.tensors.get("memory_mask")
        state["memory_length"] = mask.shape[-1] if mask is not None and mask.ndim == 2 else 0
        return streaming, state

    @property
    def batch_size(self) -> int:
        return self.tensors["next_position"].shape[0]

    def _check_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise self._fail(f"the tensor '{name}' is missing")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise self._fail(
                f"'{name}' is {tensor.dtype} of shape {tuple(tensor.shape)}, expected {dtype} of shape {shape}"
            )

    def _check_row_layout(self) -> None:
        positions = self.tensors.get("next_position")
        if positions is None or positions.ndim != 1 or positions.shape[0] < 1:
            raise self._fail("'next_position' must be a non-empty 1-D tensor (one entry per user)")
        batch = self.batch_size
        mask = self.tensors.get("memory_mask")
        width = mask.shape[-1] if mask is not None and mask.ndim == 2 else -1
        self._check_tensor("memory_mask", torch.bool, (batch, width))
        self._check_tensor("next_position", torch.long, (batch,))
        self._check_tensor("steps", torch.long, (batch,))
        # Written only for a memory that was re-based (files before it never are).
        if "rebased" in self.tensors:
            self._check_tensor("rebased", torch.long, (batch,))
        most, config = self._most_slots, self.spec.config
        if width > most:
            raise self._fail(f"it holds {width} memory slots, more than this adapter's memory can ({most})")
        if config.update != "concat" and width not in (0, config.num_comp_tokens):
            # The average is one block of `<COMP>` slots (said to be "more than" it, a slot fewer was not).
            raise self._fail(
                f"it holds {width} memory slots, where {config.update} memory holds 0 or {config.num_comp_tokens}"
            )

    @property
    def _most_slots(self) -> int:
        """The most memory slots a row of this adapter's memory holds."""
        config = self.spec.config
        if self.streaming is not None:
            return self.streaming.memory_slots(config)
        if config.update == "concat":
            return (
                config.max_memory_tokens
                if config.max_memory_tokens is not None
                else self.tensors["memory_mask"].shape[1]
            )
        return config.num_comp_tokens

    def _check_row_values(self) -> None:
        positions, mask, steps = (self.tensors[name] for name in ("next_position", "memory_mask", "steps"))
        rebased = self.tensors.get("rebased", torch.zeros_like(steps))
        # Their sum is the row's history in tokens: one that overflows int64 wraps to a negative count.
        history = positions + rebased
        if any(bool((values < 0).any()) for values in (positions, steps, rebased, history)):
            raise self._fail("'next_position', 'steps', 'rebased' and 'next_position' + 'rebased' must be >= 0")
        if bool((history > MOST_HISTORY_TOKENS).any()):
            raise self._fail(
                f"its rows have taken in {history.tolist()} tokens ('next_position' + 'rebased'), more than any memory "
                f"does ({MOST_HISTORY_TOKENS})"
            )
        if self.streaming is None:
            self._check_folds(mask, positions, steps)
        else:
            self._check_stream_folds(mask, steps)
        # A count past the bound (a concat cap or merge/EMA memory hides it from the slots) wrapped to a negative one
        # at the next fold (merge then took that fold's keys/values alone), and the memory saved after it never loaded.
        if bool((steps > MOST_FOLDS).any()):
            raise self._fail(
                f"its rows folded {steps.tolist()} contexts ('steps'), more than any memory counts ({MOST_FOLDS})"
            )

    def _check_folds(self, mask: torch.Tensor, positions: torch.Tensor, steps: torch.Tensor) -> None:
        """Raise unless each row's slots and position are what its number of folded contexts gives: concat
        keeps `num_comp_tokens` slots per context (its newest `max_memory_tokens` under a cap), merge and EMA
        `num_comp_tokens` once a context was folded; positions are re-based before they pass the model's."""
        config, n = self.spec.config, self.spec.config.num_comp_tokens
        if config.update == "concat":
            # Clamped first, so that a crafted count cannot overflow; past the width it fails the check anyway.
            folded = steps.clamp(max=mask.shape[1] + 1) * n
            if config.max_memory_tokens is not None:
                folded = folded.clamp(max=config.max_memory_tokens)
        else:
            folded = (steps > 0).long() * n
        owned = mask.sum(dim=1)
        if not torch.equal(owned, folded):
            raise self._fail(
                f"its rows own {owned.tolist()} memory slots, which the contexts they folded ('steps' "
                f"{steps.tolist()}) cannot give ({config.update}, {n} per context)"
            )
        most = self.spec.max_positions
        if most is not None and bool((positions > most).any()):
            raise self._fail(f"'next_position' {positions.tolist()} passes the model's {most} positions")

    def row_lengths(self) -> torch.Tensor:
        """`(batch, 4)` long: each row's sink, memory and window tokens and its window tokens already compressed
        (`CompressedMemoryCache.stream_lengths`): the file's per-row lengths, or its header's, which every row
        shares."""
        if "stream_lengths" in self.tensors:
            return self.tensors["stream_lengths"]
        state = self.stream_state
        row = [state["sink_length"], state["memory_length"], state["window_length"], state["compressed_in_window"]]
        return torch.tensor([row] * self.batch_size, dtype=torch.long)

    def _check_stream_folds(self, mask: torch.Tensor, steps: torch.Tensor) -> None:
        """Raise unless the stream is laid out as the model leaves one: each row owns its first memory slots, as many
        as its count of compressed chunks gives (concat: `num_comp_tokens` per chunk, the newest `max_memory_tokens`;
        merge and EMA: `num_comp_tokens` once one was compressed), its lengths fit the stream's sizes, and nothing
        follows its sink before it is full (new tokens would go to the sink, behind the window)."""
        config, n, streaming, state = (
            self.spec.config,
            self.spec.config.num_comp_tokens,
            self.streaming,
            self.stream_state,
        )
        assert streaming is not None
        lengths = self.row_lengths()
        sink, memory, window, compressed = lengths.unbind(1)
        if "stream_lengths" in self.tensors:
            longest = [int(column.max()) for column in (sink, window, compressed)]
            if (
                bool((lengths < 0).any())
                or int((sink + memory + window).max()) != state["kv_length"]
                or longest != [state["sink_length"], state["window_length"], state["compressed_in_window"]]
            ):
                raise self._fail(
                    f"its rows' lengths 'stream_lengths' {lengths.tolist()} are not those its header gives ({state})"
                )
            # Each row's sink and window are then within the stream's sizes: the longest are the header's (checked).
        width = mask.shape[1]
        if config.update == "concat":
            # Clamped first, so that a crafted count cannot overflow.
            expected = (steps.clamp(max=width + 1) * n).clamp(max=streaming.max_memory_tokens)
        else:
            expected = (steps > 0).long() * n
        owned = mask.sum(dim=1)
        if not torch.equal(owned, expected) or width != int(expected.max()):
            raise self._fail(
                f"its rows own {owned.tolist()} of {width} memory slots, which the chunks they compressed ('steps' "
                f"{steps.tolist()}) cannot give ({config.update}, {n} per chunk)"
            )
        if not torch.equal(mask, torch.arange(width)[None] < owned[:, None]) or not torch.equal(memory, owned):
            raise self._fail("a row's memory slots are not its first ones, as a stream lays them out")
        # Window tokens already compressed (`keep_window_full`) are evicted without a compression of their own: more
        # than the chunk last compressed would drop tokens that no memory slot holds.
        kept = streaming.compress_chunk if streaming.compress and streaming.keep_window_full else 0
        most = torch.where(steps > 0, kept, 0)
        if bool((compressed > most).any()):
            raise self._fail(
                f"its window holds {compressed.tolist()} tokens already compressed, more than this stream leaves there "
                f"({most.tolist()})"
            )
        # Said apart: the count of the one above was named, which this one's is within ("[3, 3] ... more than [4, 4]").
        if bool((compressed > window).any()):
            raise self._fail(
                f"its window holds {compressed.tolist()} tokens already compressed, more than the {window.tolist()} "
                "tokens it holds"
            )
        early = (sink < streaming.sink_tokens) & (memory + window > 0)
        if bool(early.any()):
            raise self._fail(
                f"its sink holds {sink.tolist()} of {streaming.sink_tokens} tokens, yet memory or window tokens "
                "follow it"
            )

    def _check_layer_layout(self) -> None:
        spec, batch, memory = self.spec, self.batch_size, self.tensors["memory_mask"].shape[1]
        length = memory
        if self.streaming is not None:
            state = self.stream_state
            length = state.get("kv_length", state["sink_length"] + memory + state["window_length"])
        known = {"memory_mask", "next_position", "steps", "rebased"}
        if self.streaming is not None and "stream_lengths" in self.tensors:
            self._check_tensor("stream_lengths", torch.long, (batch, 4))
            known.add("stream_lengths")
        for index in range(spec.num_layers):
            if length == 0:
                continue
            expected = {
                "keys": (spec.dtype, (batch, spec.kv_heads, length, spec.head_dim)),
                "values": (spec.dtype, (batch, spec.kv_heads, length, spec.head_dim)),
            }
            # `held` writes the float32 merge/EMA average only where it is not the memory itself.
            averaged = spec.config.update != "concat" and spec.dtype != torch.float32
            if averaged and f"layers.{index}.accumulated_keys" in self.tensors:
                slots = (batch, spec.kv_heads, memory, spec.head_dim)
                expected.update(accumulated_keys=(torch.float32, slots), accumulated_values=(torch.float32, slots))
            # `held` writes a stream's float32 keys where the keys are not float32 themselves.
            if (
                self.streaming is not None
                and spec.dtype != torch.float32
                and f"layers.{index}.float_keys" in self.tensors
            ):
                expected["float_keys"] = (torch.float32, expected["keys"][1])
            for name, (dtype, shape) in expected.items():
                self._check_tensor(f"layers.{index}.{name}", dtype, shape)
                known.add(f"layers.{index}.{name}")
        unknown = sorted(set(self.tensors) - known)
        if unknown:
            raise self._fail(f"it holds unexpected tensors {unknown[:4]}")

    def _check_layer_values(self) -> None:
        for index in range(self.spec.num_layers):
            if f"layers.{index}.accumulated_keys" in self.tensors:
                self._check_average(index)
            if f"layers.{index}.float_keys" in self.tensors and not torch.equal(
                self.tensors[f"layers.{index}.keys"], self.tensors[f"layers.{index}.float_keys"].to(self.spec.dtype)
            ):
                # `restore` moves the keys from their float32 copy: keys that differ would be silently replaced.
                raise self._fail(
                    f"'layers.{index}.keys' is not the cast of its float32 copy 'layers.{index}.float_keys'"
                )

    def _check_average(self, index: int) -> None:
        """Raise unless layer `index`'s memory is the cast of its float32 average, as the model always leaves it:
        `restore` rebuilds the memory from the average, so a memory that differs would be silently replaced."""
        if self.streaming is None:
            starts = torch.zeros(self.batch_size, dtype=torch.long)
            owned = torch.ones(self.batch_size, dtype=torch.bool)
        else:  # each row's memory follows its sink; a row without memory keeps no average
            lengths = self.row_lengths()
            starts, owned = lengths[:, 0], lengths[:, 1] > 0
        for part in ("keys", "values"):
            average = self.tensors[f"layers.{index}.accumulated_{part}"]
            held = self.tensors[f"layers.{index}.{part}"]
            where = (starts[:, None] + torch.arange(average.shape[2]))[:, None, :, None]
            memory = held.gather(2, where.clamp(max=held.shape[2] - 1).expand(-1, held.shape[1], -1, held.shape[3]))
            same = (memory == average.to(memory.dtype)).flatten(1).all(dim=1)
            if not bool((same | ~owned).all()):
                raise self._fail(
                    f"'layers.{index}.{part}' is not its float32 average 'layers.{index}.accumulated_{part}'"
                )

    def layer_state(self, index: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{index}."
        return {name.removeprefix(prefix): t for name, t in self.tensors.items() if name.startswith(prefix)}


# A crafted file's signature may differ in any number of entries, of any size: the message names the first ones
# (more than two real base configs differ in), each name and value cut short, not megabytes of them.
_SHOWN_DIFFERENCES = 32
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 100


def signature_differences(found: dict[str, Any], expected: dict[str, Any], source: str) -> str:
    """The fields of `expected` that `found` does not match, as 'field: source X vs model Y, ...'; inside a field
    that holds an object (the base config), only its entries that differ, as 'field.entry: ...'."""
    differing = _differing(found, expected, source, sorted(expected))
    more = len(differing) - _SHOWN_DIFFERENCES
    return ", ".join(differing[:_SHOWN_DIFFERENCES] + ([f"and {more} more"] if more > 0 else []))


def _differing(found: dict[str, Any], expected: dict[str, Any], source: str, keys: list[str]) -> list[str]:
    differing = []
    for key in keys:
        got, wanted = found.get(key), expected.get(key)
        if got == wanted:
            continue
        name = key if len(key) <= _SHORT_REPR.maxstring else f"{key[: _SHORT_REPR.maxstring]}..."
        if isinstance(got, dict) and isinstance(wanted, dict):
            inner = _differing(got, wanted, source, sorted(got.keys() | wanted.keys()))
            differing += [f"{name}.{difference}" for difference in inner]
        else:
            differing.append(f"{name}: {source} {_SHORT_REPR.repr(got)} vs model {_SHORT_REPR.repr(wanted)}")
    return differing
