"""The documentation and the code say the same: the flags the docs give each `ccm` command exist, their Python
snippets parse and import what exists, and every public name is documented."""

import argparse
import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import transformers_ccm
from transformers_ccm.cli import build_parser

ROOT = Path(__file__).parent.parent
# What a new user reads: the README, the guides, the Makefile's commands and the shipped adapters' model cards.
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "Makefile",
    *sorted((ROOT / "src" / "transformers_ccm" / "adapters").glob("*/README.md")),
]
# `ccm <command>` (or `-m transformers_ccm.cli <command>`) and its arguments, over `\` line continuations, up to the
# end of the line, of the inline code span or of a comment.
COMMAND = re.compile(r"(?:\bccm|transformers_ccm\.cli)\s+(train|eval|stream-eval|chat|demo)\b((?:\\\n|[^`#\n])*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _command_options() -> dict[str, set[str]]:
    commands = next(action for action in build_parser()._actions if action.dest == "command").choices
    return {name: {flag for action in sub._actions for flag in action.option_strings} for name, sub in commands.items()}


def _python_blocks() -> list[tuple[str, str]]:
    return [
        (f"{path.relative_to(ROOT)}:{path.read_text()[: block.start()].count(chr(10)) + 1}", block.group(1))
        for path in DOCS
        if path.suffix == ".md"
        for block in re.finditer(r"```python\n(.*?)```", path.read_text(), re.S)
    ]


def test_every_flag_the_docs_give_a_command_is_one_of_its_options():
    options = _command_options()
    used = [
        (f"{path.relative_to(ROOT)}:{text[: command.start()].count(chr(10)) + 1}", command.group(1), flag)
        for path in DOCS
        for text in [path.read_text()]
        for command in COMMAND.finditer(text)
        for flag in FLAG.findall(command.group(2))
    ]
    assert len(used) > 100  # the docs' command lines were found
    unknown = [f"{where}: ccm {name} {flag}" for where, name, flag in used if flag not in options[name]]
    assert not unknown, unknown


# The defaults the guides state: "300 steps of batch 8 at 1e-3", "LoRA rank 8" (training.md); 4 sink tokens, 32-token
# chunks, at most 8 memory slots, a 148-token window, 16 tokens per forward (streaming.md).
DOCUMENTED_DEFAULTS = {
    ("train", "--steps"): "300",
    ("train", "--batch-size"): "8",
    ("train", "--learning-rate"): "0.001",
    ("train", "--lora-r"): "8",
    ("train", "--compress-chunk"): "32",
    ("train", "--sink-tokens"): "4",
    ("train", "--window-tokens"): "148",
    ("train", "--stream-chunks"): "8",
    ("train", "--stream-piece"): "16",
    ("train", "--supervision"): "output",
    ("train", "--precision"): "auto",
    ("eval", "--samples"): "200",
    ("stream-eval", "--sink-tokens"): "4",
    ("stream-eval", "--compress-chunk"): "32",
    ("stream-eval", "--max-memory-tokens"): "8",
    ("stream-eval", "--window-tokens"): "148",
    ("stream-eval", "--piece"): "16",
}


def test_help_gives_each_default_as_the_docs_state_it():
    """`ccm <command> --help` gave no default for most options (the steps, batch size and learning rate of train, the
    stream sizes of stream-eval): each option that has one now says it, and says what the docs say."""
    commands = next(action for action in build_parser()._actions if action.dest == "command").choices

    def shown(name: str, action: argparse.Action) -> str:
        # What --help prints for the option (argparse prints nothing for an option without help).
        return commands[name]._get_formatter()._expand_help(action) if action.help else ""

    for name, sub in commands.items():
        for action in sub._actions:
            unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
            if action.option_strings and not unset:
                assert "default" in shown(name, action), f"ccm {name} {action.option_strings[0]}"
    for (name, flag), value in DOCUMENTED_DEFAULTS.items():
        action = next(action for action in commands[name]._actions if flag in action.option_strings)
        assert re.search(rf"default:? {re.escape(value)}\b", shown(name, action)), f"ccm {name} {flag}"


@pytest.mark.parametrize(("where", "code"), _python_blocks(), ids=lambda value: value.split("\n")[0][:40])
def test_python_snippets_parse_and_import_what_exists(where, code):
    tree = ast.parse(code, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "transformers_ccm":
            module = importlib.import_module(node.module)
            missing = [alias.name for alias in node.names if not hasattr(module, alias.name)]
            assert not missing, f"{where}: {node.module} has no {missing}"


def test_every_dotted_name_the_guides_give_exists():
    named = {
        match.group(1)
        for path in DOCS
        if path.suffix == ".md"
        for match in re.finditer(r"`(transformers_ccm(?:\.\w+)+)", path.read_text())
    }
    assert len(named) > 5  # the guides' references were found
    for name in named:
        parts = name.split(".")
        # The longest importable prefix is the module; the rest are attributes.
        depth = next(depth for depth in range(len(parts), 0, -1) if _importable(".".join(parts[:depth])))
        value = importlib.import_module(".".join(parts[:depth]))
        for attribute in parts[depth:]:
            assert hasattr(value, attribute), f"{name}: no {attribute}"
            value = getattr(value, attribute)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def test_every_public_name_has_docstrings_and_appears_in_the_docs():
    guides = "\n".join(path.read_text() for path in DOCS if path.suffix == ".md")
    undocumented = []
    for name in transformers_ccm.__all__:
        value = getattr(transformers_ccm, name)
        if not inspect.isclass(value):
            continue
        assert f"`{name}" in guides, f"{name} is exported but no guide names it"
        undocumented += [name] if not inspect.getdoc(value) else []
        # Its own members and those of its bases in this package (AdapterHubMixin's save_pretrained, ...).
        for owner in (cls for cls in value.__mro__ if cls.__module__.startswith("transformers_ccm")):
            for member, attribute in vars(owner).items():
                function = attribute.fget if isinstance(attribute, property) else attribute
                function = getattr(function, "__func__", function)  # a classmethod's or staticmethod's
                if not member.startswith("_") and callable(function) and not (function.__doc__ or "").strip():
                    undocumented.append(f"{name}.{member}")
    assert not undocumented, undocumented
