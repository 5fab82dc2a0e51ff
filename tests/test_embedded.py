"""The embedded model: converted from its GGUF file once, kept checked, and the same model as transformers reads."""

import fcntl
import json
import logging
import os
import resource
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from test_files import file_size_limit
from transformers_ccm.embedded import (
    CACHE_ENV,
    CONVERTED_MANIFEST,
    GGUF_FILE,
    _damage,
    converted_cache_root,
    embedded_model_folder,
    load_base_config,
    load_base_model,
    load_tokenizer,
)
from transformers_ccm.files import STAGING_PREFIX

TEXTS = [
    "Hello world",
    "  two spaces\n\nand newlines\tand a tab",
    "ünïcödé, 日本語 and 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    "x" * 300,
]
MESSAGES = [{"role": "user", "content": "Hi, I'm Ada."}, {"role": "assistant", "content": "Hello Ada!"}]


def _converted_parts(root: Path) -> list[Path]:
    return sorted(root.glob("*/*"))


def _tokenizes_as(tokenizer, reference) -> None:
    assert [tokenizer(text).input_ids for text in TEXTS] == [reference(text).input_ids for text in TEXTS]
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == reference.apply_chat_template(
        MESSAGES, tokenize=False
    )
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side) == (
        reference.bos_token,
        reference.eos_token,
        reference.pad_token,
        reference.padding_side,
    )


@pytest.mark.slow  # reads the 98 MB GGUF file twice (about 40 s); the copy's manifest digests hold it between runs
def test_the_converted_model_and_tokenizer_are_the_gguf_ones_bit_for_bit():
    """What a load reads from the converted copy (the session's) is what transformers reads from the GGUF file."""
    folder = embedded_model_folder()
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = load_base_model("default")
    expected, found = reference.state_dict(), model.state_dict()
    assert list(found) == list(expected)
    assert all(torch.equal(found[name], expected[name]) for name in expected)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert model.dtype == torch.float32 and model.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    ignored = {"_name_or_path", "quantization_config"}
    reference_config = {k: v for k, v in reference.config.to_dict().items() if k not in ignored}
    assert {k: v for k, v in model.config.to_dict().items() if k not in ignored} == reference_config
    assert {k: v for k, v in load_base_config("default").to_dict().items() if k not in ignored} == reference_config
    assert model.generation_config.to_dict() == reference.generation_config.to_dict()
    ids = torch.tensor([[1, 504, 2365, 6354, 253, 28, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    _tokenizes_as(load_tokenizer("default"), AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE))
    assert [part.name for part in _converted_parts(converted_cache_root())] == ["model", "tokenizer"]
    assert model.half().dtype == torch.float16  # a plain model: one read from the GGUF file refused the cast


def test_threads_converting_at_once_keep_one_copy_and_a_damaged_copy_is_converted_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    loaded, failures = [], []

    def load() -> None:
        try:
            loaded.append(load_tokenizer("default"))
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and len(loaded) == 2
    (part,) = _converted_parts(tmp_path)
    assert part.name == "tokenizer" and not list(part.parent.glob(f"{STAGING_PREFIX}*"))
    _tokenizes_as(loaded[1], loaded[0])

    vocabulary = part / "tokenizer.json"
    content = bytearray(vocabulary.read_bytes())
    content[content.index(b'"Hello"') + 1] = ord("J")  # still JSON, another tokenizer
    vocabulary.write_bytes(bytes(content))
    with caplog.at_level(logging.WARNING, logger="transformers_ccm.embedded"):
        again = load_tokenizer("default")
    assert f"The converted embedded model at {part} is damaged (tokenizer.json is not the file" in caplog.text
    _tokenizes_as(again, loaded[0])
    assert vocabulary.read_bytes() != bytes(content)


DAMAGES = {
    "a file changed": lambda part: (part / "tokenizer_config.json").write_text("{}"),
    "a file removed": lambda part: (part / "chat_template.jinja").unlink(),
    "a file added": lambda part: (part / "adapter_config.json").write_text("{}"),
    "no manifest": lambda part: (part / CONVERTED_MANIFEST).unlink(),
    "a manifest that is no JSON": lambda part: (part / CONVERTED_MANIFEST).write_text("{"),
    "a manifest that is a folder": lambda part: [
        (part / CONVERTED_MANIFEST).unlink(),
        (part / CONVERTED_MANIFEST).mkdir(),
    ],
    "a manifest of another format": lambda part: (part / CONVERTED_MANIFEST).write_text(
        json.dumps({"format_version": 2, "sha256": json.loads((part / CONVERTED_MANIFEST).read_text())["sha256"]})
    ),
    "a file replaced by a link to its copy": lambda part: [
        shutil.copy(part / "tokenizer.json", part.parent / "copy.json"),
        (part / "tokenizer.json").unlink(),
        (part / "tokenizer.json").symlink_to(part.parent / "copy.json"),
    ],
}


@pytest.fixture(scope="module")
def converted_tokenizer(tmp_path_factory) -> Path:
    """A converted tokenizer part, made once for the module."""
    root = tmp_path_factory.mktemp("converted")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(root))
        load_tokenizer("default")
    (part,) = _converted_parts(root)
    return part


@pytest.mark.parametrize("damage", DAMAGES)
def test_every_change_to_a_converted_copy_is_found(converted_tokenizer, tmp_path, damage):
    part = tmp_path / "version" / "tokenizer"
    shutil.copytree(converted_tokenizer, part)
    assert _damage(part) is None
    DAMAGES[damage](part)
    assert _damage(part) is not None


NOT_FOLDERS = {
    "a named pipe": lambda part, elsewhere: os.mkfifo(part),
    "a link to a good copy": lambda part, elsewhere: part.symlink_to(elsewhere, target_is_directory=True),
}


def test_a_load_checks_the_digests_of_the_files_it_reads_and_the_list_of_all(converted_tokenizer, tmp_path):
    """A config alone is read without hashing the weights (half a second each `from_pretrained`), but not from a copy
    whose files differ from its manifest's list."""
    part = tmp_path / "version" / "tokenizer"
    shutil.copytree(converted_tokenizer, part)
    (part / "tokenizer.json").write_text("{}")
    assert _damage(part, ("tokenizer_config.json",)) is None
    assert _damage(part) == f"tokenizer.json is not the file {CONVERTED_MANIFEST} records"
    (part / "tokenizer_config.json").write_text("{}")
    changed = f"tokenizer_config.json is not the file {CONVERTED_MANIFEST} records"
    assert _damage(part, ("tokenizer_config.json",)) == changed
    (part / "chat_template.jinja").unlink()
    assert _damage(part, ()) is not None and "are not those" in _damage(part, ())


@pytest.mark.parametrize("kind", NOT_FOLDERS)
def test_a_copy_that_is_no_folder_is_converted_again(converted_tokenizer, tmp_path, monkeypatch, caplog, kind):
    """A copy's place holding a link was found damaged but never replaced (every load read the GGUF file, with a
    warning that the cache folder could not be written), and one holding a named pipe hung every load for ever. It is
    removed now, and what a link leads to is left as it was."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(converted_tokenizer, elsewhere)
    part = tmp_path / "cache" / converted_tokenizer.parent.name / "tokenizer"
    part.parent.mkdir(parents=True)
    NOT_FOLDERS[kind](part, elsewhere)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    loaded = []
    # In a thread that the test does not wait for past a minute: the pipe's load never returned.
    thread = threading.Thread(target=lambda: loaded.append(load_tokenizer("default")), daemon=True)
    with caplog.at_level(logging.WARNING, logger="transformers_ccm.embedded"):
        thread.start()
        thread.join(timeout=60)
    assert len(loaded) == 1
    damaged = f"The converted embedded model at {part} is damaged (not a folder); converting it again."
    assert caplog.messages == [damaged]
    assert not part.is_symlink() and _damage(part) is None and os.listdir(part.parent) == ["tokenizer"]
    _tokenizes_as(loaded[0], AutoTokenizer.from_pretrained(converted_tokenizer))
    assert _damage(elsewhere) is None and sorted(os.listdir(elsewhere)) == sorted(os.listdir(converted_tokenizer))


def test_what_a_conversion_killed_part_way_left_beside_a_good_copy_is_removed(
    converted_tokenizer, tmp_path, monkeypatch
):
    """Two processes converted at once, and one was killed part way (SIGKILL, the OOM killer): its staging folder, a
    model's worth of hundreds of MB, stayed for good, as the next conversion that removes such folders never came. A
    live conversion's (held locked) is left alone."""
    part = tmp_path / converted_tokenizer.parent.name / "tokenizer"
    shutil.copytree(converted_tokenizer, part)
    killed, live = (part.parent / f"{STAGING_PREFIX}{index}" for index in ("5f97e3774c51edd1-1", "5f97e3774c51edd1-2"))
    for staging in (killed, live):
        (staging / "tokenizer").mkdir(parents=True)
        (staging / "tokenizer" / "tokenizer.json").write_bytes(b'{"version"')  # written part way
    descriptor = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        monkeypatch.setenv(CACHE_ENV, str(tmp_path))
        _tokenizes_as(load_tokenizer("default"), AutoTokenizer.from_pretrained(converted_tokenizer))
        assert sorted(os.listdir(part.parent)) == sorted([live.name, "tokenizer"]) and _damage(part) is None
    finally:
        os.close(descriptor)


def test_a_cache_root_that_cannot_be_written_warns_and_still_loads(tmp_path, monkeypatch, caplog):
    reference = load_tokenizer("default")  # the session's copy
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="transformers_ccm.embedded"):
        tokenizer = load_tokenizer("default")
    assert f"Cannot keep the converted embedded model in {blocker / 'cache'}" in caplog.text
    assert f"set {CACHE_ENV} to a writable folder" in caplog.text
    _tokenizes_as(tokenizer, reference)
    assert os.listdir(tmp_path) == ["a-file"]


def test_a_conversion_the_disk_cannot_take_leaves_nothing_and_the_gguf_file_is_read(tmp_path, monkeypatch, caplog):
    """A full disk part way through the tokenizer.json: no copy, no staging folder, a warning, the same tokenizer."""
    reference = load_tokenizer("default")  # the session's copy
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="transformers_ccm.embedded"), file_size_limit(1 << 20):
        tokenizer = load_tokenizer("default")
    assert f"Cannot keep the converted embedded model in {tmp_path}" in caplog.text and "File too large" in caplog.text
    _tokenizes_as(tokenizer, reference)
    (version,) = tmp_path.iterdir()
    assert os.listdir(version) == []


def test_an_empty_cache_setting_keeps_no_copy(tmp_path, monkeypatch):
    reference = load_tokenizer("default")  # the session's copy
    monkeypatch.setenv(CACHE_ENV, "")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    assert converted_cache_root() is None
    _tokenizes_as(load_tokenizer("default"), reference)
    assert sorted(os.listdir(tmp_path)) == ["tmp"] and os.listdir(tmp_path / "tmp") == []


@pytest.mark.slow
def test_a_memory_of_the_default_model_loads_whether_the_model_was_read_from_its_copy_or_its_gguf_file(
    tmp_path, monkeypatch
):
    """The model read from the GGUF file records it as its quantization_config, which the memory's signature held: a
    memory made where no copy is kept (and every one made before copies were) was refused by the model read from its
    copy, and the other way."""
    from transformers_ccm import CCMForCausalLM, CompressedMemoryCache

    from_copy = CCMForCausalLM.from_pretrained("ccm:smollm2-concat")  # the session's copy
    monkeypatch.setenv(CACHE_ENV, "")
    from_gguf = CCMForCausalLM.from_pretrained("ccm:smollm2-concat")
    for maker, reader in ((from_gguf, from_copy), (from_copy, from_gguf)):
        cache = maker.new_cache()
        maker.compress(cache, torch.tensor([[504, 2365, 6354, 253]]))
        cache.save(tmp_path / "user.safetensors")
        loaded = CompressedMemoryCache.load(tmp_path / "user.safetensors", reader)
        assert all(
            torch.equal(made.keys, read.keys) and torch.equal(made.values, read.values)
            for made, read in zip(cache.layers, loaded.layers, strict=True)
        )


@pytest.mark.slow
def test_a_conversion_that_the_disk_refuses_warns_and_reads_the_gguf_file(tmp_path, monkeypatch, caplog):
    """safetensors raised its own SafetensorError, no OSError, when the disk refused the copy's weights (full, or as
    here a file size limit): the load failed with a traceback instead of reading the GGUF file."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not the whole process
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
    try:
        with caplog.at_level(logging.WARNING, logger="transformers_ccm.embedded"):
            config = load_base_config("default")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    refused = f"Cannot keep the converted embedded model in {tmp_path / 'cache'} ([Errno 27] File too large)"
    assert refused in caplog.text
    assert config.num_hidden_layers == 30 and config.hidden_size == 576
    assert [path for path in (tmp_path / "cache").rglob("*") if not path.is_dir()] == []
