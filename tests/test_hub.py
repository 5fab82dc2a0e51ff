"""Adapters as files: save, load (folder or Hub cache, offline), push, and the errors that keep loads whole."""

import ast
import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import ClassVar

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard, RepoUrl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftConfig, PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from crafted_files import with_huge_tensor
from fault_injection import paused_at
from tiny_models import ARCHITECTURES, randomize_adapter, tiny_base, tiny_ccm
from transformers_ccm import CCMConfig, CCMForCausalLM
from transformers_ccm import hub as hub_module
from transformers_ccm.config import CONFIG_MAX_BYTES
from transformers_ccm.hub import resolve_adapter
from transformers_ccm.lora import lora_layers

PROMPT = torch.tensor([[20, 21, 22]])
CONTEXT = torch.tensor([[5, 6, 7, 8]])
ADAPTER_FILES = {
    "adapter_config.json",
    "adapter_model.safetensors",
    "ccm_config.json",
    "README.md",
    "ccm_manifest.json",
}


def _adapter(base_path=None, seed=1, **config):
    config.setdefault("base_model_name_or_path", base_path)
    return randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(**config)), seed=seed)


def _answer(model):
    """Logits of a prompt after compressing a context, and a greedy continuation."""
    cache = model.new_cache()
    model.compress(cache, CONTEXT)
    with torch.no_grad():
        logits = model(input_ids=PROMPT, past_key_values=model.new_cache()).logits
    cache_for_generate = model.new_cache()
    model.compress(cache_for_generate, CONTEXT)
    tokens = model.generate(PROMPT, past_key_values=cache_for_generate, max_new_tokens=5, do_sample=False)
    return logits, tokens


@pytest.fixture
def base_folder(tmp_path):
    folder = tmp_path / "tiny-llama"
    tiny_base("llama").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_save_then_load_gives_identical_logits_and_generation(tmp_path, base_folder, update):
    model = _adapter(str(base_folder), update=update)
    model.save_pretrained(tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == ADAPTER_FILES
    loaded = CCMForCausalLM.from_pretrained(tmp_path / "adapter").eval()  # resolves the base model itself
    assert loaded.config == model.config
    for got, expected in zip(_answer(loaded), _answer(model), strict=True):
        assert torch.equal(got, expected)


def _two_memories(model):
    memories = []
    for _ in range(2):
        cache = model.new_cache()
        model.compress(cache, CONTEXT)
        memories.append(torch.cat([layer.keys for layer in cache.layers]))
    return memories


LOADS = {
    "from_pretrained": lambda adapter, base: CCMForCausalLM.from_pretrained(adapter),
    "from_pretrained with a loaded base": lambda adapter, base: CCMForCausalLM.from_pretrained(
        adapter, base_model=tiny_base("llama")
    ),
    "from_base, then load_adapter": lambda adapter, base: _loaded_into(
        CCMForCausalLM.from_base(base, CCMConfig(lora_dropout=0.5)), adapter
    ),
}


def _loaded_into(model, adapter):
    model.load_adapter(adapter)
    return model


@pytest.mark.parametrize("load", sorted(LOADS))
def test_a_loaded_model_compresses_the_same_memory_every_time(tmp_path, base_folder, load):
    """The LoRA's dropout modules, new in the base model, started in training mode (and the wrapper with them) while
    transformers loads the base in eval mode: every compress of a model just loaded dropped random LoRA inputs, so
    the same context gave another memory each time. The model now takes its base model's mode."""
    _adapter(str(base_folder), lora_dropout=0.5).save_pretrained(tmp_path / "adapter")
    model = LOADS[load](tmp_path / "adapter", str(base_folder))
    assert not any(module.training for module in model.modules())
    first, second = _two_memories(model)
    assert torch.equal(first, second)
    model.train()  # training mode is the caller's to ask for, and keeps the dropout it trains with
    first, second = _two_memories(model)
    assert not torch.equal(first, second)


def test_saved_files_are_peft_format_and_hold_no_base_weights(tmp_path, base_folder):
    model = _adapter(str(base_folder), trained_on="synthetic recall")
    model.save_pretrained(tmp_path / "adapter")
    peft_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert peft_config["peft_type"] == "LORA" and peft_config["r"] == 8
    assert peft_config["base_model_name_or_path"] == str(base_folder)
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as file:
        keys = set(file.keys())
    assert "ccm.comp_embeddings" in keys
    lora = keys - {"ccm.comp_embeddings"}
    assert lora and all(k.startswith("base_model.model.") and ".lora_" in k for k in lora)
    ccm = json.loads((tmp_path / "adapter" / "ccm_config.json").read_text())
    assert ccm["update"] == "concat" and ccm["ccm_version"] and ccm["base_model_shape"]["model_type"] == "llama"
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "library_name: transformers-ccm" in card and "- ccm" in card and "- context-compression" in card
    assert "synthetic recall" in card and "CCMForCausalLM.from_pretrained" in card
    assert not list((tmp_path / "adapter").glob("*.bin")) and not list((tmp_path / "adapter").glob("model*"))


@pytest.mark.parametrize("failing", ["save_file", "_model_card"])
def test_a_save_that_fails_midway_keeps_the_adapter_saved_before(tmp_path, monkeypatch, failing):
    """Saving over an adapter writes every file aside first: a full disk leaves the earlier adapter whole, and
    other files of the folder (training checkpoints) are never touched."""
    folder = tmp_path / "adapter"
    earlier = _adapter(None, seed=1)
    earlier.save_pretrained(folder)
    (folder / "checkpoint-2").mkdir()
    before = {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
    original = getattr(hub_module, failing)

    def full_disk(*args, **kwargs):
        original(*args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hub_module, failing, full_disk)
    with pytest.raises(OSError, match="No space left"):
        _adapter(None, seed=2, update="merge").save_pretrained(folder)
    assert {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()} == before
    assert sorted(path.name for path in folder.iterdir()) == sorted([*ADAPTER_FILES, "checkpoint-2"])
    target = _adapter(None, seed=9)
    target.load_adapter(folder)
    assert all(torch.equal(value, earlier.adapter_tensors()[key]) for key, value in target.adapter_tensors().items())


def _stepping(model):
    """An SGD optimizer over `model`'s adapter with a gradient on every weight, to step while a save runs."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trainable:
        parameter.grad = torch.ones_like(parameter)
    return torch.optim.SGD(trainable, lr=0.5)


def _saved_tensors(folder):
    target = _adapter(None, seed=9)
    target.load_adapter(folder)
    return target.adapter_tensors()


def test_a_save_holds_the_weights_it_read_though_a_step_follows_before_the_write(tmp_path):
    """The save writes copies taken in one pass, not the live parameters: an optimizer step in another thread
    between the read and the write leaves the file with the weights as they were when save_pretrained read them."""
    model = _adapter(None, seed=1)
    optimizer = _stepping(model)
    read = {key: value.clone() for key, value in model.adapter_tensors().items()}
    folder = tmp_path / "adapter"
    with paused_at(hub_module.replace_files.__code__, lambda: model.save_pretrained(folder)) as paused:
        optimizer.step()
    assert paused["outcome"][0] == "result", paused["outcome"]
    stepped = model.adapter_tensors()
    assert all(not torch.equal(stepped[key], value) for key, value in read.items())  # the step moved every weight
    saved = _saved_tensors(folder)
    assert saved.keys() == read.keys()
    assert all(torch.equal(saved[key], value) for key, value in read.items())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_step_while_the_save_reads_the_weights_is_refused_and_writes_nothing(tmp_path, data):
    """An optimizer step in another thread while the save copies the weights (before any one of them) would leave
    copies of two states: the save says so and the folder keeps the adapter saved there before."""
    folder = tmp_path / f"adapter-{data.draw(st.uuids()).hex}"
    _adapter(None, seed=2).save_pretrained(folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    model = _adapter(None, seed=1)
    optimizer = _stepping(model)
    entry = data.draw(st.integers(1, len(model.adapter_tensors())), label="the copy the step comes before")
    with paused_at(hub_module._cpu_copy.__code__, lambda: model.save_pretrained(folder), entry=entry) as paused:
        optimizer.step()
    kind, error = paused["outcome"]
    assert kind == "error" and error[0] is ValueError, paused["outcome"]
    assert "changed while they were being saved" in error[1] and "retry the save" in error[1]
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    model.save_pretrained(folder)  # with no step running, the same save goes through
    saved = _saved_tensors(folder)
    assert all(torch.equal(saved[key], value) for key, value in model.adapter_tensors().items())


def test_hub_card_names_hub_base_model(tmp_path):
    model = _adapter("acme/tiny-llama")
    model.save_pretrained(tmp_path / "adapter")
    assert "base_model: acme/tiny-llama" in (tmp_path / "adapter" / "README.md").read_text()


@pytest.mark.parametrize(
    ("setting", "stated"),
    [
        ({"update": "ema", "ema_alpha": 0.25}, "updated by **ema** (each new context weighted by ema_alpha = 0.25)."),
        (
            {"update": "concat", "max_memory_tokens": 6},
            "updated by **concat** (at most max_memory_tokens = 6 slots per layer, the oldest dropped first).",
        ),
        ({"update": "concat"}, "updated by **concat**."),
        ({"update": "merge"}, "updated by **merge**."),
    ],
)
def test_the_model_card_states_the_update_rules_setting(tmp_path, setting, stated):
    """A card said "updated by **ema**" whatever its ema_alpha, and nothing of a concat memory's cap."""
    CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(**setting)).save_pretrained(tmp_path)
    assert stated in " ".join((tmp_path / "README.md").read_text().split())


@pytest.mark.parametrize("base", ["acme/tiny-llama", None, "folder"])
def test_the_model_card_links_and_loads_the_base_model_as_it_can(tmp_path, base):
    """The card linked https://huggingface.co/unknown for an adapter that names no base, and huggingface.co/<path>
    for a local folder, and told to load either without base_model=, which from_pretrained then asks for."""
    base_path = str(tmp_path / base) if base == "folder" else base
    if base == "folder":
        tiny_base("llama").save_pretrained(base_path)
    _adapter(base_path).save_pretrained(tmp_path / "adapter")
    card = (tmp_path / "adapter" / "README.md").read_text()
    arguments = _card_load_arguments(card)
    links = re.findall(r"https://huggingface\.co/[^)\s]*", card)
    if base == "acme/tiny-llama":
        assert links == ["https://huggingface.co/acme/tiny-llama"] and arguments == [str(tmp_path / "adapter")]
    else:
        assert links == [] and "base_model: " not in card
        assert arguments == [str(tmp_path / "adapter"), ("base_model", base_path or "path-or-hub-id")]


def _card_load_arguments(card):
    """The arguments of the model card's `from_pretrained(...)` call, as Python reads its snippet: literals, and
    keyword arguments as (name, literal)."""
    (snippet,) = re.findall(r"```python\n(.*?)```", card, re.S)
    call = next(
        node
        for node in ast.walk(ast.parse(snippet))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained"
    )
    return [ast.literal_eval(arg) for arg in call.args] + [
        (keyword.arg, ast.literal_eval(keyword.value)) for keyword in call.keywords
    ]


_NAME_CHARACTERS = st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.text(_NAME_CHARACTERS, min_size=1, max_size=8).filter(lambda name: name not in (".", "..")),
    base=st.text(st.sampled_from("ab\"'\\\n/ é"), min_size=1, max_size=8).map(lambda name: f"/models/{name}"),
)
def test_the_model_card_loads_the_exact_paths_whatever_their_characters(tmp_path, name, base):
    """A folder or base model path with a quote, a backslash or a newline ended the snippet's string literal early:
    the card's Python was invalid, or loaded another path."""
    folder = tmp_path / f'{name}"\\\n'
    _adapter(base).save_pretrained(folder)
    card = (folder / "README.md").read_text()
    assert _card_load_arguments(card) == [str(folder), ("base_model", base)]


def test_load_with_a_given_base_model(tmp_path):
    model = _adapter(None)
    model.save_pretrained(tmp_path / "adapter")
    loaded = CCMForCausalLM.from_pretrained(tmp_path / "adapter", base_model=tiny_base("llama")).eval()
    assert torch.equal(_answer(loaded)[1], _answer(model)[1])


def test_load_adapter_replaces_weights(tmp_path):
    source = _adapter(None, seed=3, update="merge")
    source.save_pretrained(tmp_path / "adapter")
    target = _adapter(None, seed=4)
    target.load_adapter(tmp_path / "adapter")
    assert target.config.update == "merge"
    assert torch.equal(_answer(target.eval())[0], _answer(source)[0])


@pytest.mark.parametrize("other_step", ["load_adapter", "save_pretrained"])
def test_an_adapter_step_of_another_thread_during_load_adapter_is_refused(tmp_path, other_step):
    """A second load_adapter in another thread while one ran left the model with a mix of both adapters (the early
    layers of one, the rest and the config of the other), and a save_pretrained meanwhile wrote such a mix."""
    first, second = _adapter(None, seed=3, update="merge"), _adapter(None, seed=5, update="ema")
    first.save_pretrained(tmp_path / "first")
    second.save_pretrained(tmp_path / "second")
    model = _adapter(None, seed=4)
    steps = {
        "load_adapter": lambda: model.load_adapter(tmp_path / "second"),
        "save_pretrained": lambda: model.save_pretrained(tmp_path / "saved"),
    }
    refusals, test_thread = [], threading.current_thread()

    def other_thread():
        try:
            steps[other_step]()
            refusals.append(None)
        except ValueError as error:
            refusals.append(error)

    def run_other_thread(*_):
        if threading.current_thread() is test_thread:  # once, not again in the other thread's load
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()

    lora_layers(model.base_model)[1].lora_B["default"].register_load_state_dict_pre_hook(run_other_thread)
    model.load_adapter(tmp_path / "first")
    assert len(refusals) == 1 and "another thread runs load_adapter()" in str(refusals[0])
    assert model.memory_signature() == first.memory_signature() and model.config.update == "merge"
    assert not (tmp_path / "saved").exists()


def _hub_cache_repo(cache, repo_id, commit, source, branch="main"):
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(commit)


LOAD_SCRIPT = """
import json, sys, torch
from transformers_ccm import CCMForCausalLM
model = CCMForCausalLM.from_pretrained("acme/tiny-ccm", revision=sys.argv[1] or None).eval()
cache = model.new_cache()
model.compress(cache, torch.tensor([[5, 6, 7, 8]]))
with torch.no_grad():
    logits = model(input_ids=torch.tensor([[20, 21, 22]]), past_key_values=cache).logits
print(json.dumps({"logits": logits.flatten().tolist(), "update": model.config.update}))
"""


def test_load_by_repo_id_from_hub_cache_offline_with_revision_pinning(tmp_path, base_folder):
    cache = tmp_path / "hub"
    _hub_cache_repo(cache, "acme/tiny-llama", "c" * 40, base_folder)
    old, new = _adapter("acme/tiny-llama", seed=5), _adapter("acme/tiny-llama", seed=6, update="merge")
    old.save_pretrained(tmp_path / "old")
    new.save_pretrained(tmp_path / "new")
    _hub_cache_repo(cache, "acme/tiny-ccm", "a" * 40, tmp_path / "old")
    _hub_cache_repo(cache, "acme/tiny-ccm", "b" * 40, tmp_path / "new")  # main now points to the new one
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}

    def load(revision):
        result = subprocess.run(
            [sys.executable, "-c", LOAD_SCRIPT, revision], env=env, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    for revision, model, update in (("", new, "merge"), ("a" * 40, old, "concat")):
        loaded = load(revision)
        cache_ = model.new_cache()
        model.compress(cache_, CONTEXT)
        with torch.no_grad():
            expected = model(input_ids=PROMPT, past_key_values=cache_).logits.flatten()
        assert loaded["update"] == update
        torch.testing.assert_close(torch.tensor(loaded["logits"]), expected, atol=1e-6, rtol=0)


@contextmanager
def _hub_that_answers_nothing():
    """A Hub endpoint on this machine that closes every connection without an answer, and the list of the request
    lines (such as `GET /api/models/acme/tiny-ccm ...`) it was sent."""
    server = socket.create_server(("127.0.0.1", 0))
    requests = []

    def serve():
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # shut down at the end
                return
            with connection:
                requests.append(connection.recv(65536).decode("latin-1").split("\r\n", 1)[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", requests
    finally:
        server.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way, which a close alone leaves blocked
        server.close()
        thread.join()


def test_local_files_only_and_subfolder_apply_to_the_adapter_as_in_peft(tmp_path, base_folder, monkeypatch):
    """Both went to the base model only: `local_files_only` asked the Hub for the adapter all the same (and failed
    with a Hub that cannot answer), `subfolder` made the base model load from its own subfolder and the adapter
    load from the repo's top."""
    cache = tmp_path / "hub"
    top, inner = _adapter("acme/tiny-llama", seed=5), _adapter("acme/tiny-llama", seed=6, update="merge")
    top.save_pretrained(tmp_path / "repo")
    inner.save_pretrained(tmp_path / "repo" / "adapters" / "merge")
    _hub_cache_repo(cache, "acme/tiny-ccm", "a" * 40, tmp_path / "repo")
    with _hub_that_answers_nothing() as (endpoint, requests):
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        for subfolder, expected in ((None, top), ("adapters/merge", inner), ("./adapters//merge/", inner)):
            loaded = CCMForCausalLM.from_pretrained(
                "acme/tiny-ccm", tiny_base("llama"), cache_dir=cache, local_files_only=True, subfolder=subfolder
            )
            assert loaded.memory_signature() == expected.memory_signature()
            target = _adapter("acme/tiny-llama", seed=9)
            target.load_adapter("acme/tiny-ccm", cache_dir=cache, local_files_only=True, subfolder=subfolder)
            assert target.memory_signature() == expected.memory_signature()
        assert not [line for line in requests if "tiny-ccm" in line]
        # Without local_files_only the adapter is looked up on the Hub, which hangs up here.
        with pytest.raises(Exception, match="disconnected without sending a response"):
            CCMForCausalLM.from_pretrained("acme/tiny-ccm", tiny_base("llama"), cache_dir=cache)
        assert [line for line in requests if "tiny-ccm" in line]
    local = CCMForCausalLM.from_pretrained(tmp_path / "repo", subfolder="adapters/merge", base_model=base_folder)
    assert local.memory_signature() == inner.memory_signature()


def test_a_hub_snapshot_cut_short_asks_to_download_it_again(tmp_path, saved_adapter):
    """A download cut short leaves the snapshot's link to a blob still `.incomplete`: the error said to save the
    adapter again, which a user who downloaded it cannot."""
    repo = tmp_path / "hub" / "models--acme--tiny-ccm"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in Path(saved_adapter).iterdir():
        shutil.copy(file, repo / "blobs" / file.name)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", file.name))
    (repo / "blobs" / "adapter_model.safetensors").rename(repo / "blobs" / "adapter_model.safetensors.incomplete")
    with pytest.raises(FileNotFoundError, match=r"no adapter_model\.safetensors; .* download it again"):
        hub_module.read_adapter(snapshot)


@pytest.mark.parametrize(
    ("subfolder", "error", "message"),
    [
        ("adapters/concat", FileNotFoundError, "has no folder 'adapters/concat'; pass the subfolder"),
        ("../repo", ValueError, "leads out of the adapter's repo or folder"),
        ("adapters/../../repo", ValueError, "leads out of the adapter's repo or folder"),
        ("/etc", ValueError, "leads out of the adapter's repo or folder"),
        (3, TypeError, "subfolder must be a string"),
    ],
)
def test_a_subfolder_that_is_not_there_or_leads_out_is_refused_naming_it(tmp_path, subfolder, error, message):
    tiny_ccm("llama").save_pretrained(tmp_path / "repo" / "adapters" / "merge")
    with pytest.raises(error, match=re.escape(message)):
        resolve_adapter(tmp_path / "repo", subfolder=subfolder)


class FakeHfApi:
    """Stands in for the Hub at the network boundary and records what it is handed."""

    calls: ClassVar[list] = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, exist_ok=False, repo_type=None):
        self.calls.append(("create_repo", repo_id, private, exist_ok, self.token))
        # As the Hub does: a name without a namespace is created under the token's user ("me").
        return RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'me/' + repo_id}")

    def create_branch(self, repo_id, branch, exist_ok=False, repo_type=None):
        self.calls.append(("create_branch", repo_id, branch, exist_ok))

    def upload_folder(
        self,
        repo_id,
        folder_path,
        commit_message=None,
        commit_description=None,
        repo_type=None,
        revision=None,
        create_pr=False,
    ):
        files = {p.name: p.stat().st_size for p in Path(folder_path).iterdir()}
        self.calls.append(("upload_folder", repo_id, commit_message, files))
        self.calls.append(("to", revision, create_pr))
        self.calls.append(("described", commit_description, ModelCard.load(Path(folder_path) / "README.md").data.tags))
        return "commit-info"


def test_push_to_hub_uploads_adapter_files_in_one_commit(monkeypatch):
    FakeHfApi.calls = []
    monkeypatch.setattr(hub_module, "HfApi", FakeHfApi)
    model = _adapter("acme/tiny-llama")
    result = model.push_to_hub("me/tiny-ccm", private=True, commit_message="first adapter", token="hf_x")
    assert result == "commit-info"
    (create, upload, to, described) = FakeHfApi.calls
    assert create == ("create_repo", "me/tiny-ccm", True, True, "hf_x") and to == ("to", None, False)
    assert described == ("described", None, ["ccm", "context-compression", "peft", "lora", "ccm-concat"])
    assert upload[:3] == ("upload_folder", "me/tiny-ccm", "first adapter")
    assert set(upload[3]) == ADAPTER_FILES
    base_bytes = sum(p.numel() * p.element_size() for p in model.base_model.parameters())
    assert upload[3]["adapter_model.safetensors"] < base_bytes / 2  # the adapter, not the base weights


@pytest.mark.parametrize(
    ("revision", "create_pr", "branch"), [("dev", False, "dev"), ("dev", True, "dev"), ("refs/pr/3", False, None)]
)
def test_push_to_hub_goes_to_the_branch_or_pull_request_asked_for(monkeypatch, revision, create_pr, branch):
    """As transformers' push_to_hub: `revision` and `create_pr` were refused as unexpected arguments."""
    FakeHfApi.calls = []
    monkeypatch.setattr(hub_module, "HfApi", FakeHfApi)
    _adapter("acme/tiny-llama").push_to_hub("me/tiny-ccm", revision=revision, create_pr=create_pr)
    branches = [call[1:] for call in FakeHfApi.calls if call[0] == "create_branch"]
    assert branches == ([("me/tiny-ccm", branch, True)] if branch else [])
    assert ("to", revision, create_pr) in FakeHfApi.calls


def test_a_name_without_namespace_is_pushed_to_the_repo_the_hub_created(monkeypatch):
    """The Hub creates a bare name under the user's namespace; the upload went to the bare name (another repo, or
    none) and the model card told to load it by that name."""
    FakeHfApi.calls = []
    monkeypatch.setattr(hub_module, "HfApi", FakeHfApi)
    uploaded = {}
    original = FakeHfApi.upload_folder

    def upload_folder(self, repo_id, folder_path, **kwargs):
        uploaded["card"] = (Path(folder_path) / "README.md").read_text()
        return original(self, repo_id, folder_path, **kwargs)

    monkeypatch.setattr(FakeHfApi, "upload_folder", upload_folder)
    _adapter("acme/tiny-llama").push_to_hub("tiny-ccm")
    (create, upload, *_) = FakeHfApi.calls
    assert create[1] == "tiny-ccm" and upload[1] == "me/tiny-ccm"
    assert _card_load_arguments(uploaded["card"]) == ["me/tiny-ccm"]


def test_a_pushed_adapter_loads_back_whole_and_a_failed_upload_leaves_nothing_behind(tmp_path, monkeypatch):
    """The files handed to the Hub are one save (their manifest agrees with them); an upload that fails at the
    network raises as it is and removes the folder it was staged in."""
    FakeHfApi.calls = []
    monkeypatch.setattr(hub_module, "HfApi", FakeHfApi)
    staged = []

    def upload_folder(self, repo_id, folder_path, **kwargs):
        staged.append(Path(folder_path))
        shutil.copytree(folder_path, tmp_path / f"hub-{len(staged)}")
        if len(staged) == 2:
            raise ConnectionError("the connection to the Hub was reset")
        return "commit-info"

    monkeypatch.setattr(FakeHfApi, "upload_folder", upload_folder)
    model = _adapter(None, seed=3, update="merge")
    model.push_to_hub("me/tiny-ccm")
    with pytest.raises(ConnectionError, match="reset"):
        model.push_to_hub("me/tiny-ccm")
    assert not any(folder.exists() for folder in staged)
    target = _adapter(None, seed=9)
    target.load_adapter(tmp_path / "hub-1")
    assert target.memory_signature() == model.memory_signature()


@pytest.mark.parametrize("tags", [None, "chat", ["chat", "ccm", "chat"], ("memory",)])
def test_push_to_hub_takes_the_arguments_of_transformers_and_peft(monkeypatch, tags):
    """`commit_description`, `tags`, `safe_serialization=True` and `max_shard_size`, as transformers and PEFT users
    pass them, failed with "unexpected keyword argument": the description goes with the commit, the tags onto the
    model card beside the adapter's own (once each), and an adapter is one file whatever the shard size."""
    FakeHfApi.calls = []
    monkeypatch.setattr(hub_module, "HfApi", FakeHfApi)
    _adapter("acme/tiny-llama").push_to_hub(
        "me/tiny-ccm",
        commit_description="two <COMP> tokens",
        tags=tags,
        safe_serialization=True,
        max_shard_size="1KB",
    )
    own = ["ccm", "context-compression", "peft", "lora", "ccm-concat"]
    given = [tags] if isinstance(tags, str) else list(tags or [])
    assert FakeHfApi.calls[-1] == (
        "described",
        "two <COMP> tokens",
        own + [t for t in dict.fromkeys(given) if t not in own],
    )
    assert set(FakeHfApi.calls[1][3]) == ADAPTER_FILES  # one weights file, however small the shard size


@pytest.mark.parametrize(
    ("arguments", "error", "refusal"),
    [
        ({"safe_serialization": False}, ValueError, r"saved as safetensors only .* push_to_hub without safe_serial"),
        ({"safe_serialization": "yes"}, ValueError, r"safe_serialization must be True or False, got 'yes'"),
        ({"create_pr": "no"}, ValueError, r"create_pr must be True or False, got 'no'"),
        ({"private": "no"}, ValueError, r"private must be True or False, got 'no'"),
        ({"tags": ["chat", 3]}, TypeError, r"tags must be a string or a list of strings"),
        ({"tags": [""]}, TypeError, r"tags must be a string or a list of strings"),
        ({"tags": {"a": 1}}, TypeError, r"tags must be a string or a list of strings"),
        ({"commit_description": 3}, TypeError, r"commit_description must be a string"),
        ({"max_shard_size": "big"}, ValueError, r"max_shard_size must be"),
    ],
)
def test_push_to_hub_refuses_arguments_it_cannot_apply_before_any_request(monkeypatch, arguments, error, refusal):
    """A pickle (`safe_serialization=False`) is never written; a string where a flag is expected ("no") is truthy, and
    opened a pull request or a private repo that the caller said not to. Each is refused before the repo is made."""
    FakeHfApi.calls = []
    monkeypatch.setattr(hub_module, "HfApi", FakeHfApi)
    with pytest.raises(error, match=refusal):
        _adapter("acme/tiny-llama").push_to_hub("me/tiny-ccm", **arguments)
    assert FakeHfApi.calls == []


@pytest.mark.parametrize(
    "repo_id", ["", "me/tiny/ccm", "me/tiny ccm", "../tiny", "ccm:smollm2-concat", "me/x.git", 5, None]
)
def test_a_repo_id_the_hub_cannot_hold_is_refused_before_any_request(monkeypatch, repo_id):
    FakeHfApi.calls = []
    monkeypatch.setattr(hub_module, "HfApi", FakeHfApi)
    with pytest.raises(ValueError, match="not a valid Hub repo id"):
        _adapter("acme/tiny-llama").push_to_hub(repo_id)
    assert FakeHfApi.calls == []


# ----- errors ----------------------------------------------------------------------------------------------------


def test_base_model_of_another_shape_fails_before_loading_weights(tmp_path, base_folder):
    _adapter(str(base_folder)).save_pretrained(tmp_path / "adapter")
    other = tmp_path / "other-base"
    other.mkdir()
    config = json.loads((base_folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 48, "head_dim": 12}))
    # other-base has no weights at all: reaching them would raise a different error
    with pytest.raises(
        ValueError, match=r"made for .*tiny-llama.* does not match the base model .*other-base.*hidden_size"
    ):
        CCMForCausalLM.from_pretrained(tmp_path / "adapter", base_model=other)
    with pytest.raises(ValueError, match="model_type: adapter 'llama' vs base 'qwen3'"):
        CCMForCausalLM.from_pretrained(tmp_path / "adapter", base_model=tiny_base("qwen3"))


def test_a_shape_mismatch_between_unnamed_models_says_so(tmp_path):
    """An adapter of a model built from a config records no base name, and such a model has an empty name_or_path:
    the error read "made for None, which does not match the base model ''"."""
    CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError) as error:
        CCMForCausalLM.from_pretrained(tmp_path / "adapter", base_model=tiny_base("qwen3"))
    assert str(error.value).startswith(
        "This adapter was made for a base model whose name it does not record, which does not match the base model "
        "(a model without a name_or_path) (model_type: adapter 'llama' vs base 'qwen3'"
    )


def test_missing_and_corrupt_files(tmp_path, base_folder):
    _adapter(str(base_folder)).save_pretrained(tmp_path / "adapter")
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "adapter", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 30)
    with pytest.raises(ValueError, match="corrupt adapter file"):
        CCMForCausalLM.from_pretrained(broken)
    (broken / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no adapter_model\.safetensors"):
        CCMForCausalLM.from_pretrained(broken)
    shutil.copy(tmp_path / "adapter" / "adapter_model.safetensors", broken)
    (broken / "ccm_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"mixes files of different saves: \['ccm_config\.json'\]"):
        CCMForCausalLM.from_pretrained(broken)
    _record(broken)  # damaged as its manifest records it: the file itself is refused
    with pytest.raises(ValueError, match="corrupt"):
        CCMForCausalLM.from_pretrained(broken)


def test_unknown_config_version(tmp_path, base_folder):
    _adapter(str(base_folder)).save_pretrained(tmp_path / "adapter")
    path = tmp_path / "adapter" / "ccm_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 7}))
    _record(path.parent)
    with pytest.raises(ValueError, match="format_version 7"):
        CCMForCausalLM.from_pretrained(tmp_path / "adapter")


def test_folders_without_ccm_files_say_what_they_are(tmp_path, base_folder):
    from peft import LoraConfig, get_peft_model

    get_peft_model(tiny_base("llama"), LoraConfig(target_modules=["q_proj"])).save_pretrained(tmp_path / "peft")
    with pytest.raises(FileNotFoundError, match="plain PEFT LORA adapter"):
        CCMForCausalLM.from_pretrained(tmp_path / "peft")
    with pytest.raises(FileNotFoundError, match="full transformers model"):
        CCMForCausalLM.from_pretrained(base_folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no ccm_config\.json"):
        CCMForCausalLM.from_pretrained(tmp_path / "empty")
    for damaged in ("[1]", "[" * 100_000, b"\xff"):  # a PEFT config that is not one still gets the same answer
        (tmp_path / "damaged").mkdir(exist_ok=True)
        path = tmp_path / "damaged" / "adapter_config.json"
        path.write_bytes(damaged.encode() if isinstance(damaged, str) else damaged)
        with pytest.raises(FileNotFoundError, match=r"plain PEFT adapter for None without ccm_config\.json"):
            CCMForCausalLM.from_pretrained(tmp_path / "damaged")
    (tmp_path / "peft" / "ccm_config.json").mkdir()  # a CCM adapter whose config is not a file is no plain PEFT one
    with pytest.raises(FileNotFoundError, match=r"its ccm_config\.json is not a file"):
        CCMForCausalLM.from_pretrained(tmp_path / "peft")


def test_load_adapter_of_another_structure_changes_nothing(tmp_path):
    _adapter(None, num_comp_tokens=4).save_pretrained(tmp_path / "four")
    target = _adapter(None, seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match="num_comp_tokens: adapter 4 vs model 2"):
        target.load_adapter(tmp_path / "four")
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(("saved", "wanted"), [(1, 3), (3, 2), (2, 2)])
def test_load_adapter_resizes_comp_tokens_when_asked(tmp_path, saved, wanted):
    source = _adapter(None, seed=3, num_comp_tokens=saved)
    source.save_pretrained(tmp_path / "adapter")
    target = _adapter(None, seed=9, num_comp_tokens=wanted)
    target.load_adapter(tmp_path / "adapter", resize_comp_tokens=True)
    assert target.config.num_comp_tokens == wanted and target.comp_embeddings.shape[0] == wanted
    kept = source.comp_embeddings.detach()
    rows = [kept[min(row, saved - 1)] for row in range(wanted)]  # the saved rows, then copies of the last
    assert torch.equal(target.comp_embeddings.detach(), torch.stack(rows))
    assert all(torch.equal(value, target.lora_state_dict()[name]) for name, value in source.lora_state_dict().items())


def test_resizing_past_the_adapters_concat_cap_is_refused_naming_both_and_changes_nothing(tmp_path):
    """A cap that cannot hold one context of the resized <COMP> block was refused with CCMConfig's own message, which
    named neither the adapter nor the resize."""
    _adapter(None, max_memory_tokens=3).save_pretrained(tmp_path / "capped")
    target = _adapter(None, seed=9, num_comp_tokens=4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    config = copy.deepcopy(target.config)
    with pytest.raises(
        ValueError,
        match=r"capped caps concat memory at 3 slots, fewer than one context of this model's 4 <COMP> tokens; resize "
        r"it to at most 3",
    ):
        target.load_adapter(tmp_path / "capped", resize_comp_tokens=True)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert target.config == config


_WITH_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def test_load_adapter_extends_targets_when_asked(tmp_path):
    """An attention-only adapter loads into a model that also adapts its MLP, which then computes exactly what the
    saved adapter computes: the added layers start at zero."""
    source = _adapter(None, seed=3)
    source.save_pretrained(tmp_path / "adapter")
    target = _adapter(None, seed=9, target_modules=_WITH_MLP)
    with pytest.raises(ValueError, match="target_modules: adapter None vs model"):
        target.load_adapter(tmp_path / "adapter")
    target.load_adapter(tmp_path / "adapter", extend_targets=True)
    assert target.config.target_modules == _WITH_MLP
    weights = target.lora_state_dict()
    added = [key for key in weights if "mlp" in key and "lora_B" in key]
    assert added and all(not weights[key].any() for key in added)
    assert all(torch.equal(value, weights[name]) for name, value in source.lora_state_dict().items())
    assert torch.equal(_logits_from_memory(target), _logits_from_memory(source))


def test_an_adapter_config_lists_its_target_modules_in_one_order_whatever_the_process(tmp_path):
    """PEFT holds a list of target modules as a set and wrote them in the set's order, which each process's string
    hashing changes: one adapter saved in two processes gave two adapter_config.json files (and manifests). They are
    written sorted, also when the list was given in another order."""
    targets = [*_WITH_MLP, "gate_proj"]
    for name, order in (("given", targets), ("reversed", targets[::-1])):
        _adapter(None, target_modules=order).save_pretrained(tmp_path / name)
    first, second = ((tmp_path / name / "adapter_config.json").read_bytes() for name in ("given", "reversed"))
    assert json.loads(first)["target_modules"] == sorted(targets) and first == second
    assert CCMForCausalLM.from_pretrained(tmp_path / "given", base_model=tiny_base("llama")).config.target_modules == (
        targets
    )


def _logits_from_memory(model):
    cache = model.new_cache()
    model.compress(cache, CONTEXT)
    with torch.no_grad():
        return model(input_ids=PROMPT, past_key_values=cache).logits


def test_extending_targets_refuses_an_adapter_that_covers_others_or_lacks_its_own(tmp_path):
    _adapter(None, seed=3, target_modules=_WITH_MLP).save_pretrained(tmp_path / "wider")
    _adapter(None, seed=3).save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "adapter_model.safetensors"
    _rewrite_weights(
        weights, lambda tensors: {k: v for k, v in tensors.items() if ".layers.0.self_attn.q_proj" not in k}
    )
    target = _adapter(None, seed=9, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"do not fit this model \(unexpected: .*down_proj"):
        target.load_adapter(tmp_path / "wider", extend_targets=True)
    # Its own targets cover the first layer's q_proj: a file without it is cut short, not a smaller adapter.
    with pytest.raises(ValueError, match=r"do not fit this model \(missing: .*layers\.0\.self_attn\.q_proj"):
        target.load_adapter(tmp_path / "cut", extend_targets=True)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def test_resizing_a_crafted_comp_embedding_is_refused_and_changes_nothing(tmp_path):
    from safetensors.torch import load_file, save_file

    _adapter(None).save_pretrained(tmp_path / "adapter")
    weights = str(tmp_path / "adapter" / "adapter_model.safetensors")
    tensors = load_file(weights)
    save_file({**tensors, "ccm.comp_embeddings": tensors["ccm.comp_embeddings"][:0]}, weights)
    _record(tmp_path / "adapter")
    target = _adapter(None, seed=9, num_comp_tokens=3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"ccm\.comp_embeddings has shape \(0, 32\) where num_comp_tokens=2"):
        target.load_adapter(tmp_path / "adapter", resize_comp_tokens=True)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _rewrite_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    _record(path.parent)


def _rewrite_weights(path, change):
    from safetensors.torch import load_file, save_file

    save_file(change(load_file(str(path))), str(path))
    _record(path.parent)


def _rewrite_text(path, old, new):
    path.write_text(path.read_text().replace(old, new))
    _record(path.parent)


def _record(folder):
    """Record the folder's files in its manifest: a crafted adapter whose manifest agrees is checked by content."""
    hub_module._write_manifest(str(folder / "ccm_manifest.json"))


def _nan_comp(tensors):
    return {**tensors, "ccm.comp_embeddings": torch.full_like(tensors["ccm.comp_embeddings"], float("nan"))}


def _integer_lora(tensors):
    key = next(k for k in tensors if "lora_A" in k)
    return {**tensors, key: tensors[key].long()}


def _scalar_comp(tensors):
    return {**tensors, "ccm.comp_embeddings": torch.tensor(1.0)}


def _comp_only(tensors):
    return {"ccm.comp_embeddings": tensors["ccm.comp_embeddings"]}


def _also_unprefixed(tensors):
    key = next(k for k in tensors if "lora_B" in k)
    return {**tensors, key.removeprefix("base_model.model."): tensors[key] + 1}


def _lower_rank(tensors):
    key = next(k for k in tensors if "lora_A" in k)
    return {**tensors, key: tensors[key][:-1]}


@pytest.mark.parametrize(
    ("craft", "named"),
    [
        (lambda f: _rewrite_json(f / "ccm_config.json", num_comp_tokens=10**9), r"num_comp_tokens=1000000000"),
        (lambda f: _rewrite_json(f / "ccm_config.json", r=10**9), r"rank r=1000000000"),
        (
            # Compared with int64 slot counts, this cap wrapped: every compress left the memory empty.
            lambda f: _rewrite_json(f / "ccm_config.json", max_memory_tokens=2**63),
            r"ccm_config\.json holds a value CCMConfig refuses: CCMConfig\.max_memory_tokens must be None or an int",
        ),
        (lambda f: _rewrite_json(f / "adapter_config.json", r=3), r"adapter_config\.json has r=3 where 8"),
        (lambda f: _rewrite_json(f / "adapter_config.json", lora_alpha=1), r"lora_alpha=1 where 16"),
        (lambda f: _rewrite_json(f / "adapter_config.json", peft_type="IA3"), r"peft_type='IA3' where 'LORA'"),
        (lambda f: _rewrite_json(f / "adapter_config.json", use_dora=True), r"use_dora=True where False"),
        (
            lambda f: ((f / "adapter_config.json").write_text("[]"), _record(f)),
            r"adapter_config\.json must hold a JSON object",
        ),
        # PEFT would build another adapter from these files: a LoRA variant, trained biases, other modules.
        (lambda f: _rewrite_json(f / "adapter_config.json", bias="all"), r"bias='all' where 'none'"),
        (lambda f: _rewrite_json(f / "adapter_config.json", lora_bias=True), r"lora_bias=True where False"),
        (lambda f: _rewrite_json(f / "adapter_config.json", modules_to_save=["lm_head"]), r"modules_to_save=\['lm_hea"),
        (lambda f: _rewrite_json(f / "adapter_config.json", layer_replication=[[0, 2], [1, 2]]), r"layer_replicat"),
        (lambda f: _rewrite_json(f / "adapter_config.json", alora_invocation_tokens=[5]), r"alora_invocation_tok"),
        (lambda f: _rewrite_json(f / "adapter_config.json", target_parameters=["mlp.up_proj.weight"]), r"target_param"),
        (
            lambda f: _rewrite_json(
                f / "adapter_config.json", target_modules=list(_ATTENTION), layers_to_transform=[1]
            ),
            r"layers_to_transform=\[1\]\) leaves out modules with LoRA weights \['model\.layers\.0\.self_attn\.k_p",
        ),
        (
            lambda f: _rewrite_json(f / "adapter_config.json", exclude_modules=["q_proj"]),
            r"exclude_modules=\['q_proj'\]\) leaves out modules with LoRA weights \['model\.layers\.0\.self_attn\.q_p",
        ),
        (
            lambda f: _rewrite_json(f / "adapter_config.json", target_modules="q_proj"),
            r"target_modules='q_proj'\) leav",
        ),
        (lambda f: _rewrite_json(f / "adapter_config.json", target_modules=None), r"has no target_modules"),
        # Regular expressions PEFT would run on every module name: "(.*.*)*Z" kept a load matching for hours.
        (
            lambda f: _rewrite_json(f / "adapter_config.json", target_modules="(.*.*)*Z"),
            r"adapter_config\.json has target_modules='\(\.\*\.\*\)\*Z', a regular expression CCM never writes",
        ),
        (
            lambda f: _rewrite_json(f / "adapter_config.json", target_modules=r".*\.(q_proj|k_proj|v_proj|o_proj)"),
            r"has target_modules='\.\*\\\\\.\(q_proj\|k_proj\|v_proj\|o_proj\)', a regular expression CCM never",
        ),
        (
            lambda f: _rewrite_json(f / "adapter_config.json", exclude_modules="(x+x+)+y"),
            r"has exclude_modules='\(x\+x\+\)\+y', a regular expression CCM never writes, which is not run",
        ),
        (
            lambda f: _rewrite_json(
                f / "adapter_config.json",
                target_modules=list(_ATTENTION),
                layers_to_transform=[0, 1],
                layers_pattern=["layers", "(.*)*"],
            ),
            r"has layers_pattern=\['layers', '\(\.\*\)\*'\], a regular expression CCM never writes",
        ),
        (
            # The model was built with these targets first: PEFT's "Target modules {'nothing'} not found in the base
            # model" named no file, and a target that matched other modules loaded as weights that "do not fit".
            lambda f: _rewrite_json(f / "ccm_config.json", target_modules=["nothing"]),
            r"ccm_config\.json \(target_modules=\['nothing'\]\) leaves out modules with LoRA weights \['model\.layers",
        ),
        (
            lambda f: _rewrite_json(f / "ccm_config.json", target_modules=["lm_head", "q_proj"]),
            r"ccm_config\.json \(target_modules=\['lm_head', 'q_proj'\]\) leaves out modules with LoRA weights \['mod",
        ),
        (
            lambda f: _rewrite_json(f / "adapter_config.json", layers_to_transform=[0]),
            r"selects modules in a way PEFT refuses \(`layers_to_transform` cannot be used when `target_modules`",
        ),
        (lambda f: _rewrite_weights(f / "adapter_model.safetensors", _lower_rank), r"not of rank r=8"),
        (
            # PEFT would not load these weights; next to their prefixed names, one of the two was taken silently.
            lambda f: _rewrite_weights(f / "adapter_model.safetensors", _also_unprefixed),
            r"adapter_model\.safetensors has tensors without PEFT's key prefix 'base_model\.model\.': \['model\.lay",
        ),
        (
            # No LoRA weight to check the rank against: the model was built with a LoRA of rank 10**9 first.
            lambda f: (
                _rewrite_json(f / "ccm_config.json", r=10**9),
                _rewrite_json(f / "adapter_config.json", r=10**9),
                _rewrite_weights(f / "adapter_model.safetensors", _comp_only),
            ),
            r"adapter_model\.safetensors holds no LoRA weights",
        ),
        (
            lambda f: _rewrite_json(f / "ccm_config.json", r=-3),
            r"ccm_config\.json holds a value CCMConfig refuses: CCMConfig\.r must be a positive integer, got -3\. "
            r"Save or download the adapter again",
        ),
        (
            lambda f: _rewrite_weights(f / "adapter_model.safetensors", _nan_comp),
            r"adapter_model\.safetensors holds tensors with values that are not finite \['ccm\.comp_embeddings'\]",
        ),
        (
            lambda f: _rewrite_weights(f / "adapter_model.safetensors", _integer_lora),
            r"holds tensors that are not floating point, one value per element \[.base_model\.model\..*lora_A",
        ),
        (
            lambda f: ((f / "ccm_config.json").write_bytes(b'{"r": "\xff"}'), _record(f)),
            r"ccm_config\.json is not valid JSON",
        ),
        (
            # Loaded as ema here; a reader that keeps the first value would load concat.
            lambda f: _rewrite_text(f / "ccm_config.json", '"update": "concat"', '"update": "concat", "update": "ema"'),
            r"ccm_config\.json gives the key 'update' twice in one object",
        ),
        (
            lambda f: ((f / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000), _record(f)),
            r"adapter_config\.json is nested too deeply",
        ),
        (
            lambda f: (
                _rewrite_json(f / "ccm_config.json", base_model_shape=None),
                _rewrite_weights(f / "adapter_model.safetensors", _scalar_comp),
            ),
            r"ccm\.comp_embeddings has shape \(\) where num_comp_tokens=2",
        ),
    ],
)
def test_files_that_disagree_are_refused_before_any_model_is_built(tmp_path, base_folder, craft, named):
    """A crafted file is named with its value before anything is allocated from it (a config claiming a
    billion slots would otherwise ask for gigabytes), and the model it was to load into is left as it was."""
    _adapter(str(base_folder)).save_pretrained(tmp_path / "adapter")
    craft(tmp_path / "adapter")
    with pytest.raises(ValueError, match=named):
        CCMForCausalLM.from_pretrained(tmp_path / "adapter")
    target = _adapter(str(base_folder), seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=named):
        target.load_adapter(tmp_path / "adapter")
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def test_an_adapter_config_that_selects_every_lora_module_in_its_own_way_loads(tmp_path, base_folder):
    """Module selection is checked as PEFT selects, not by the fields it uses."""
    _adapter(str(base_folder)).save_pretrained(tmp_path / "adapter")
    _rewrite_json(
        tmp_path / "adapter" / "adapter_config.json",
        target_modules=list(_ATTENTION),
        layers_to_transform=[0, 1],
        layers_pattern="layers",
        exclude_modules=["mlp"],
    )
    loaded = CCMForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    assert all(torch.equal(a, b) for a, b in zip(_answer(loaded), _answer(_adapter(None)), strict=True))


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 10**400)
    | st.floats()
    | st.sampled_from(["", "q_proj", "(", ".*", "layers", "LORA", "none", "all"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["q_proj", "x"]), inner, max_size=2),
    max_leaves=4,
)


@pytest.fixture(scope="module")
def saved_and_target(tmp_path_factory):
    """An adapter saved to a folder, and another model to load it into (with its own weights as they were)."""
    folder = tmp_path_factory.mktemp("saved")
    saved = _adapter(None)
    saved.save_pretrained(folder)
    target = _adapter(None, seed=9)
    return folder, saved.state_dict(), target, {k: v.clone() for k, v in target.state_dict().items()}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from([f.name for f in fields(LoraConfig)]), _JSON_VALUES, max_size=2))
def test_any_value_in_adapter_config_loads_the_same_adapter_or_is_refused_naming_it(
    tmp_path_factory, saved_and_target, changes
):
    saved, saved_weights, target, own_weights = saved_and_target
    folder = tmp_path_factory.mktemp("adapter")
    shutil.copytree(saved, folder, dirs_exist_ok=True)
    _rewrite_json(folder / "adapter_config.json", **changes)
    target.load_state_dict(own_weights)
    try:
        target.load_adapter(folder)
    except ValueError as error:
        assert "adapter_config.json" in str(error), error
        assert all(torch.equal(v, target.state_dict()[k]) for k, v in own_weights.items())
    else:
        assert all(torch.equal(v, target.state_dict()[k]) for k, v in saved_weights.items())


def test_a_base_models_weights_given_as_adapter_weights_are_refused_from_their_header(tmp_path):
    """A base model's model.safetensors put in an adapter's folder was read whole (gigabytes on a real model; 1 TiB
    here, which no allocation holds) before it was refused: its header already names no CCM adapter's tensors."""
    tiny_base("llama").save_pretrained(tmp_path / "base")
    _adapter(None).save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    with_huge_tensor(tmp_path / "base" / "model.safetensors", weights, "model.embed_tokens.weight", (2**22, 2**16))
    assert os.path.getsize(weights) > 2**40
    named = r"adapter_model\.safetensors has no ccm\.comp_embeddings: not a CCM adapter file"
    with pytest.raises(ValueError, match=named):
        CCMForCausalLM.from_pretrained(tmp_path / "adapter")
    target = _adapter(None, seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=named):
        target.load_adapter(tmp_path / "adapter")
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def test_weights_that_do_not_fit_change_nothing(tmp_path):
    model = _adapter(None)
    model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    tensors.pop(next(k for k in tensors if "lora_B" in k))
    save_file(tensors, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    _record(tmp_path / "adapter")
    target = _adapter(None, seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"do not fit this model \(missing"):
        target.load_adapter(tmp_path / "adapter")
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def test_a_failed_load_gives_the_given_base_model_back_as_it_was(tmp_path):
    """from_pretrained(..., base_model=model) with weights that do not fit failed after wrapping the caller's model:
    it kept LoRA layers, hooks and a changed attention, and the next load said it "already holds LoRA layers"."""
    _adapter(None).save_pretrained(tmp_path / "good")
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    _rewrite_weights(
        tmp_path / "bad" / "adapter_model.safetensors",
        lambda tensors: {k: v for k, v in tensors.items() if k != next(k for k in tensors if "lora_B" in k)},
    )
    base = tiny_base("llama")
    base.lm_head.requires_grad_(False)  # the caller's own choice of what trains
    state = {name: (parameter.requires_grad, parameter.clone()) for name, parameter in base.named_parameters()}
    modules = {name: type(module) for name, module in base.named_modules()}
    with torch.no_grad():
        logits = base(input_ids=PROMPT).logits
    with pytest.raises(ValueError, match=r"do not fit this model \(missing"):
        CCMForCausalLM.from_pretrained(tmp_path / "bad", base_model=base)
    assert {name: type(module) for name, module in base.named_modules()} == modules
    assert all(not (m._forward_hooks or m._forward_pre_hooks) for m in base.modules())
    assert base.config._attn_implementation == "sdpa" and not hasattr(base, "peft_config")
    assert "save_pretrained" not in vars(base)  # its class's own again
    for name, parameter in base.named_parameters():
        assert parameter.requires_grad == state[name][0] and torch.equal(parameter, state[name][1]), name
    with torch.no_grad():
        assert torch.equal(base(input_ids=PROMPT).logits, logits)
    loaded = CCMForCausalLM.from_pretrained(tmp_path / "good", base_model=base).eval()
    fresh = CCMForCausalLM.from_pretrained(tmp_path / "good", base_model=tiny_base("llama")).eval()
    assert all(torch.equal(a, b) for a, b in zip(_answer(loaded), _answer(fresh), strict=True))


def _beyond_float32(tensors):
    key = next(k for k in tensors if "lora_B" in k)
    too_large = tensors[key].double()
    too_large[0, 0] = 1e39  # finite in float64, inf in float32
    return {**tensors, key: too_large}


def test_weights_beyond_the_models_range_change_nothing(tmp_path):
    """A value that is finite in the file but not in the model's dtype would be loaded as inf."""
    _adapter(None).save_pretrained(tmp_path / "adapter")
    _rewrite_weights(tmp_path / "adapter" / "adapter_model.safetensors", _beyond_float32)
    target = _adapter(None, seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"values beyond the range of torch\.float32: \['.*lora_B"):
        target.load_adapter(tmp_path / "adapter")
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    # Within float32 but not float16: refused for a half-precision model, loaded by a full-precision one.
    _adapter(None).save_pretrained(tmp_path / "large")
    _rewrite_weights(
        tmp_path / "large" / "adapter_model.safetensors",
        lambda tensors: {**tensors, "ccm.comp_embeddings": torch.full_like(tensors["ccm.comp_embeddings"], 1e5)},
    )
    _adapter(None, seed=9).load_adapter(tmp_path / "large")
    with pytest.raises(ValueError, match=r"beyond the range of torch\.float16: \['ccm\.comp_embeddings'\]"):
        _adapter(None, seed=9).to(torch.float16).load_adapter(tmp_path / "large")


def test_the_float32_adapter_of_a_float16_base_takes_values_past_float16_and_names_float32_beyond_it(tmp_path):
    """The adapter of a half-precision base is float32: a value past float16's range loads, one past float32's is
    refused under float32's name, not the base model's dtype."""
    half_base = CCMForCausalLM.from_base(tiny_base("llama").to(torch.float16), CCMConfig())
    _adapter(None).save_pretrained(tmp_path / "large")
    _rewrite_weights(
        tmp_path / "large" / "adapter_model.safetensors",
        lambda tensors: {**tensors, "ccm.comp_embeddings": torch.full_like(tensors["ccm.comp_embeddings"], 1e5)},
    )
    half_base.load_adapter(tmp_path / "large")
    assert bool((half_base.comp_embeddings == 1e5).all())
    _adapter(None).save_pretrained(tmp_path / "huge")
    _rewrite_weights(tmp_path / "huge" / "adapter_model.safetensors", _beyond_float32)
    with pytest.raises(ValueError, match=r"values beyond the range of torch\.float32: \['.*lora_B"):
        half_base.load_adapter(tmp_path / "huge")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_adapter_weights_stored_as_8_bit_floats_load_as_their_values(tmp_path, dtype):
    """`torch.isfinite` has no kernel for float8_e4m3fn: checking such weights failed with a NotImplementedError."""
    _adapter(None).save_pretrained(tmp_path / "narrow")
    _rewrite_weights(
        tmp_path / "narrow" / "adapter_model.safetensors", lambda t: {k: v.to(dtype) for k, v in t.items()}
    )
    shutil.copytree(tmp_path / "narrow", tmp_path / "widened")
    _rewrite_weights(tmp_path / "widened" / "adapter_model.safetensors", lambda t: {k: v.float() for k, v in t.items()})
    loaded = CCMForCausalLM.from_pretrained(tmp_path / "narrow", base_model=tiny_base("llama")).eval()
    widened = CCMForCausalLM.from_pretrained(tmp_path / "widened", base_model=tiny_base("llama")).eval()
    assert all(torch.equal(a, b) for a, b in zip(_answer(loaded), _answer(widened), strict=True))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda comp: torch.full_like(comp, float("nan")).to(torch.float8_e4m3fn), "with values that are not finite"),
        (
            lambda comp: torch.zeros(comp.numel() // 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
            "not floating point, one value per element",
        ),
    ],
)
def test_8_bit_nan_and_packed_4_bit_weights_are_refused_and_change_nothing(tmp_path, change, named):
    _adapter(None).save_pretrained(tmp_path / "adapter")
    _rewrite_weights(
        tmp_path / "adapter" / "adapter_model.safetensors",
        lambda tensors: {**tensors, "ccm.comp_embeddings": change(tensors["ccm.comp_embeddings"])},
    )
    target = _adapter(None, seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(
        ValueError, match=rf"adapter_model\.safetensors holds tensors .*{named}.*\['ccm\.comp_embeddings'\]"
    ):
        target.load_adapter(tmp_path / "adapter")
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(
    "name", ["ccm:../..", "ccm:../adapters/smollm2-concat", "ccm:/etc", "ccm:", "ccm:smollm2-concat/"]
)
def test_shipped_names_never_reach_other_folders(name):
    with pytest.raises(FileNotFoundError, match=r"No shipped adapter .*; shipped: \['ccm:smollm2-concat'"):
        resolve_adapter(name)


def test_an_empty_name_is_refused_even_in_an_adapters_folder(tmp_path, monkeypatch):
    """Path("") is the working folder: an empty name (an unset setting) loaded whatever adapter was there."""
    _adapter(None).save_pretrained(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^The name is empty; give an adapter's folder, its Hub id or ccm:<n"):
        CCMForCausalLM.from_pretrained("")
    with pytest.raises(FileNotFoundError, match=r"^The name is empty; give a model's folder, its Hub id or 'default'"):
        CCMForCausalLM.from_base("")


def test_a_recorded_base_model_that_is_not_here_asks_for_base_model(tmp_path, base_folder):
    """The error named the fix for a name the caller gave ("give a model's folder"), but the adapter recorded it."""
    missing = tmp_path / "trainers-machine" / "tiny-llama"
    _adapter(str(missing)).save_pretrained(tmp_path / "adapter")
    with pytest.raises(
        FileNotFoundError,
        match=rf"adapter at .*adapter was made for the base model '{missing}', which cannot be loaded here \(.*\)\. "
        r"Pass base_model= \(its folder, Hub id or loaded model\)\.",
    ):
        CCMForCausalLM.from_pretrained(tmp_path / "adapter")
    CCMForCausalLM.from_pretrained(tmp_path / "adapter", base_model=base_folder)
    _adapter(str(base_folder)).save_pretrained(tmp_path / "found")
    with pytest.raises(OSError, match=r"does not appear to have a file named absent\.gguf") as error:
        CCMForCausalLM.from_pretrained(tmp_path / "found", gguf_file="absent.gguf")  # the caller's argument failed
    assert "Pass base_model=" not in str(error.value)


def test_an_adapter_folder_given_as_base_model_says_to_load_it_with_from_pretrained(tmp_path, base_folder):
    """from_base loaded the adapter's base with its LoRA unconditional (transformers reads adapter_config.json), then
    said it "already holds LoRA layers"; as base_model= it failed for want of a model_type."""
    _adapter(str(base_folder)).save_pretrained(tmp_path / "adapter")
    message = (
        r"adapter holds a CCM adapter \(ccm_config\.json\), not a base model; load it with CCMForCausalLM\.from_pre"
    )
    with pytest.raises(FileNotFoundError, match=message):
        CCMForCausalLM.from_base(tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match=message):
        CCMForCausalLM.from_pretrained(tmp_path / "adapter", base_model=tmp_path / "adapter")


_PEFT_LOADS = {
    "PeftModel.from_pretrained": lambda folder: PeftModel.from_pretrained(tiny_base("llama"), folder),
    "AutoPeftModelForCausalLM.from_pretrained": AutoPeftModelForCausalLM.from_pretrained,
    "AutoModelForCausalLM.from_pretrained": AutoModelForCausalLM.from_pretrained,
    "load_adapter of a transformers model": lambda folder: tiny_base("llama").load_adapter(folder),
}


_REFUSED_BY_PEFT = r"Invalid task type: 'CCM_ADAPTER: .* load it with transformers_ccm\.CCMForCausalLM\.from_pretrained"


@pytest.mark.parametrize("load", sorted(_PEFT_LOADS))
def test_peft_and_transformers_refuse_a_ccm_adapter_naming_its_loader(tmp_path, base_folder, load):
    """PEFT (and transformers, which loads a folder with adapter_config.json through it) loaded a CCM adapter without
    a word: its LoRA at every token, its <COMP> embeddings dropped, a model that is neither the base nor CCM."""
    folder = tmp_path / "adapter"
    _adapter(str(base_folder)).save_pretrained(folder)
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(ValueError, match=_REFUSED_BY_PEFT):
        _PEFT_LOADS[load](folder)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == files
    CCMForCausalLM.from_pretrained(folder)
    _rewrite_json(folder / "adapter_config.json", task_type="CAUSAL_LM")  # as saved before
    CCMForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("name", hub_module.shipped_adapters())
def test_peft_refuses_the_shipped_adapters(name):
    """Every PEFT load reads the adapter's config first."""
    with pytest.raises(ValueError, match=_REFUSED_BY_PEFT):
        PeftConfig.from_pretrained(resolve_adapter(name))


def test_saving_leaves_the_live_peft_config_unchanged(tmp_path):
    model = tiny_ccm("llama")
    live = model.base_model.peft_config["default"]
    before = live.to_dict()
    model.save_pretrained(tmp_path / "adapter")
    assert live.to_dict() == before
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["task_type"] == hub_module.PEFT_TASK_TYPE


def test_a_load_that_fails_halfway_leaves_the_adapter_and_its_caches_as_they_were(tmp_path):
    """The weights were copied module by module: a failure at the sixth left five modules holding the new adapter,
    the rest the old one, and the caches made before refused."""
    from transformers_ccm.lora import lora_layers

    _adapter(None, seed=3, update="merge").save_pretrained(tmp_path / "adapter")
    target = _adapter(None, seed=9)
    cache = target.new_cache()
    target.compress(cache, CONTEXT)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    config, logits = target.config, _logits_from_memory(target)

    def fail(*_):
        raise RuntimeError("injected failure")

    handle = lora_layers(target.base_model)[5].lora_B["default"]._register_load_state_dict_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        target.load_adapter(tmp_path / "adapter")
    handle.remove()
    assert [k for k, v in before.items() if not torch.equal(v, target.state_dict()[k])] == []
    assert target.config == config and torch.equal(_logits_from_memory(target), logits)
    with torch.no_grad():
        target(input_ids=PROMPT, past_key_values=cache)  # the memory made before still fits


@pytest.mark.parametrize(
    ("saved", "own"),
    [
        (["q_proj", "k_proj"], ["k_proj", "q_proj"]),  # another order
        (["q_proj", "q_proj", "k_proj"], ["q_proj", "k_proj"]),  # a duplicate
        (["q_proj", "k_proj", "v_proj", "o_proj"], None),  # the default targets, named
    ],
)
def test_load_adapter_takes_the_same_targets_named_otherwise(tmp_path, saved, own):
    """The lists were compared as written: the same LoRA layers in another order were "another structure"."""
    source = _adapter(None, seed=3, target_modules=saved)
    source.save_pretrained(tmp_path / "adapter")
    target = _adapter(None, seed=9, target_modules=own)
    target.load_adapter(tmp_path / "adapter")
    assert target.config.target_modules == own
    assert all(torch.equal(value, source.adapter_tensors()[key]) for key, value in target.adapter_tensors().items())


def test_load_adapter_keeps_the_models_lora_dropout(tmp_path):
    """The config took the adapter's lora_dropout while the layers kept theirs, and a save recorded a dropout the
    model never trained with."""
    _adapter(None, seed=3, lora_dropout=0.2).save_pretrained(tmp_path / "adapter")
    target = _adapter(None, seed=9, lora_dropout=0.0)
    target.load_adapter(tmp_path / "adapter")
    assert target.config.lora_dropout == 0.0 == target.base_model.peft_config["default"].lora_dropout


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "adapter"
    tiny_ccm("llama").save_pretrained(folder)
    return folder


def _crafted_copy(saved_adapter: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the saved adapter and the path of its manifest."""
    folder = tmp_path / f"crafted-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(saved_adapter, folder)
    return folder, folder / "ccm_manifest.json"


def _as_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _as_pipe(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _as_link(target: str):
    def craft(path: Path) -> None:
        path.unlink()
        path.symlink_to(target)

    return craft


@pytest.mark.parametrize(
    "craft",
    [_as_folder, _as_pipe, _as_link("/dev/zero"), _as_link("/no/such/file")],
    ids=["folder", "named pipe", "link to /dev/zero", "broken link"],
)
def test_a_manifest_that_is_no_regular_file_is_refused_not_skipped(tmp_path, saved_adapter, craft):
    """Such a manifest was skipped as if there were none, and the files loaded unchecked (a pipe or a device is
    never opened: reading it would block or never end)."""
    folder, manifest = _crafted_copy(saved_adapter, tmp_path)
    craft(manifest)
    with pytest.raises(ValueError, match=rf"{manifest} is not a regular file"):
        hub_module.read_adapter(folder)


def test_a_manifest_larger_than_any_is_refused_before_it_is_read_whole(tmp_path, saved_adapter):
    folder, manifest = _crafted_copy(saved_adapter, tmp_path)
    with manifest.open("r+b") as file:
        file.truncate(1 << 30)  # sparse: a gigabyte of zeros that takes no disk
    with pytest.raises(ValueError, match=rf"{manifest} is larger than"):
        hub_module.read_adapter(folder)


@pytest.mark.parametrize("name", ["ccm_config.json", "adapter_config.json", "adapter_model.safetensors"])
def test_a_link_out_of_the_adapters_folder_is_refused_and_a_hub_snapshots_links_load(tmp_path, saved_adapter, name):
    """A file linked from elsewhere was read as the adapter's (here the very same bytes, so that nothing else tells);
    links inside the folder, and those of a Hub cache snapshot into its repository's blobs, are read as before."""
    folder, _ = _crafted_copy(saved_adapter, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (folder / name).rename(elsewhere / name)
    (folder / name).symlink_to(elsewhere / name)
    with pytest.raises(ValueError, match=rf"{folder / name} is a link to {elsewhere / name}, outside the adapter's"):
        hub_module.read_adapter(folder)
    (elsewhere / name).rename(folder / f"real-{name}")
    (folder / name).unlink()
    (folder / name).symlink_to(f"real-{name}")
    hub_module.read_adapter(folder)
    # The layout huggingface_hub writes: snapshots/<revision>/<file> -> ../../blobs/<digest>.
    repo = tmp_path / "hub" / "models--acme--tiny-ccm"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in Path(saved_adapter).iterdir():
        digest = hub_module._digest(file.read_bytes())
        shutil.copy(file, repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    assert hub_module.read_adapter(snapshot)[0] == hub_module.read_adapter(Path(saved_adapter))[0]


@pytest.mark.parametrize("name", ["ccm_config.json", "adapter_config.json"])
def test_a_config_larger_than_any_is_refused_before_it_is_read_whole(tmp_path, saved_adapter, name):
    """A crafted config of gigabytes (valid JSON: whitespace, or a long list) was read, then parsed, into memory;
    the one here, recorded in the manifest, loaded."""
    folder, _ = _crafted_copy(saved_adapter, tmp_path)
    path = folder / name
    path.write_text(path.read_text() + " " * CONFIG_MAX_BYTES)
    _record(folder)
    with pytest.raises(ValueError, match=rf"{path} is larger than {CONFIG_MAX_BYTES} bytes, more than any such file"):
        hub_module.read_adapter(folder)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    field=st.sampled_from(["format_version", "sha256", "ccm_config.json", "adapter_model.safetensors"]),
    value=_JSON_VALUES | st.from_regex(r"[0-9a-fA-F]{63,65}", fullmatch=True),
)
def test_any_value_in_a_manifest_loads_the_adapter_or_is_refused_naming_the_manifest(
    tmp_path, saved_adapter, field, value
):
    """A format version that only equals 1 (`true`, 1.0) was taken for version 1, and a digest that is no string
    of 64 hexadecimal digits was reported as files of two saves."""
    folder, manifest = _crafted_copy(saved_adapter, tmp_path)
    content = json.loads(manifest.read_text())
    if field in ("format_version", "sha256"):
        content[field] = value
    else:
        content["sha256"][field] = value
    manifest.write_text(json.dumps(content))
    if (field == "format_version" and value == 1 and type(value) is int) or (
        field not in ("format_version", "sha256") and value == hub_module._digest((folder / field).read_bytes())
    ):
        hub_module.read_adapter(folder)
        return
    with pytest.raises(ValueError, match=re.escape(str(manifest))):
        hub_module.read_adapter(folder)


def test_weights_replaced_while_an_adapter_is_read_are_read_whole_with_their_manifest(tmp_path, monkeypatch):
    """A save where folders cannot be locked puts the manifest in place first, the weights last. A reader that
    parsed the earlier weights, then read the new ones (again) for their digest, loaded the earlier weights under
    the new manifest; the weights are now read once, and parsed from the bytes whose digest is checked."""
    _adapter(None).save_pretrained(tmp_path / "earlier")
    _adapter(None, seed=9).save_pretrained(tmp_path / "new")
    folder = tmp_path / "adapter"
    shutil.copytree(tmp_path / "earlier", folder)
    for name in ADAPTER_FILES - {"adapter_model.safetensors"}:  # the save's swap so far
        shutil.copy(tmp_path / "new" / name, folder / name)
    weights, open_path = folder / "adapter_model.safetensors", Path.open

    def replaced_then_opened(path: Path, *args, **kwargs):
        if path == weights and not weights.samefile(tmp_path / "new" / weights.name):
            os.link(tmp_path / "new" / weights.name, tmp_path / "staged")
            os.replace(tmp_path / "staged", weights)  # the save's last rename
        return open_path(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", replaced_then_opened)
    _, tensors = hub_module.read_adapter(folder)
    with safe_open(tmp_path / "new" / weights.name, framework="pt") as new:
        assert tensors.keys() == {key.removeprefix(hub_module.PEFT_PREFIX) for key in new.keys()}  # noqa: SIM118
        for key in new.keys():  # noqa: SIM118 (safe_open is no dict)
            assert torch.equal(tensors[key.removeprefix(hub_module.PEFT_PREFIX)], new.get_tensor(key))


def test_torch_dtype_and_dtype_are_one_argument(tmp_path, base_folder):
    """Both gave a raw "got multiple values for keyword argument 'dtype'"; either alone loads the base in it."""
    _adapter(str(base_folder)).save_pretrained(tmp_path / "adapter")
    for dtype in ({"torch_dtype": torch.float16}, {"dtype": torch.float16}):
        assert CCMForCausalLM.from_pretrained(tmp_path / "adapter", **dtype).dtype == torch.float16
    message = (
        r"^from_pretrained got both torch_dtype=torch\.float16 and dtype=torch\.bfloat16, two names for the base "
        r"model's dtype; pass only dtype= \(transformers 5's name; torch_dtype is its older alias\)\.$"
    )
    with pytest.raises(TypeError, match=message):
        CCMForCausalLM.from_pretrained(tmp_path / "adapter", torch_dtype=torch.float16, dtype=torch.bfloat16)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(architecture=st.sampled_from(ARCHITECTURES), explicit=st.booleans())
def test_the_wrapped_base_saves_its_own_weights(tmp_path_factory, architecture, explicit):
    """`base.save_pretrained` after `from_base(base)` wrote the LoRA's entries and `base_layer` names: a reload got
    random attention weights (transformers only printed its table of missing and unexpected keys)."""
    base = tiny_base(architecture)
    expected = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    with torch.no_grad():
        expected_logits = base(PROMPT).logits
    model = randomize_adapter(CCMForCausalLM.from_base(base, CCMConfig()))
    before = _answer(model)
    folder = tmp_path_factory.mktemp("base")
    base.save_pretrained(folder, **({"state_dict": base.state_dict()} if explicit else {}))
    implementation = "eager" if architecture in ("llama-eager", "gemma2", "gpt-oss") else "sdpa"
    reloaded, info = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=implementation, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    got = reloaded.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(PROMPT).logits, expected_logits)
    for got_answer, expected_answer in zip(_answer(model), before, strict=True):  # the model itself is untouched
        assert torch.equal(got_answer, expected_answer)


def test_the_wrapped_base_refuses_a_distributed_checkpoint_and_writes_nothing(tmp_path):
    """`base.save_pretrained(folder, distributed_checkpoint=True)` ignores the state_dict the wrapped base saves:
    transformers writes the modules, LoRA included (on a model not sharded it failed after writing config.json)."""
    base = tiny_base("llama")
    CCMForCausalLM.from_base(base, CCMConfig())
    with pytest.raises(ValueError, match=r"distributed_checkpoint=True\) on a base model wrapped by a CCM model"):
        base.save_pretrained(tmp_path / "base", distributed_checkpoint=True)
    assert not (tmp_path / "base").exists()


@pytest.mark.parametrize(
    ("arguments", "refusal"),
    [
        ({"safe_serialization": True}, None),
        ({"safe_serialization": True, "is_main_process": True}, None),
        ({"is_main_process": False}, None),
        ({"safe_serialization": False}, r"saved as safetensors only .* without safe_serialization=False"),
        ({"safe_serialization": False, "is_main_process": False}, r"saved as safetensors only"),
        ({"is_main_process": "no"}, r"is_main_process must be True or False, got 'no'"),
    ],
)
def test_save_pretrained_takes_the_arguments_of_transformers_and_peft(tmp_path, arguments, refusal):
    """`save_pretrained(folder, safe_serialization=True)`, as transformers and PEFT users write it, failed on an
    unexpected keyword, and a process other than the main one (`is_main_process=False`) could not skip the write."""
    model = tiny_ccm("llama")
    model.save_pretrained(tmp_path / "plain")
    target = tmp_path / "adapter"
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            model.save_pretrained(target, **arguments)
        assert not target.exists()
        return
    model.save_pretrained(target, **arguments)
    if not arguments.get("is_main_process", True):
        assert not target.exists()
        return
    saved = {path.name: path.read_bytes() for path in target.iterdir()}
    plain = {path.name: path.read_bytes() for path in (tmp_path / "plain").iterdir()}
    assert saved.keys() == plain.keys()
    assert all(saved[name] == plain[name] for name in plain if name != "README.md")  # the card names its folder
