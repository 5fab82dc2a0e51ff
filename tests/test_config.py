import contextlib
import copy
import json
import pickle
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from crafted_files import pipe_feeding
from transformers_ccm import CCMConfig, __version__
from transformers_ccm.config import CONFIG_MAX_BYTES, CONFIG_NAME


def test_paper_defaults():
    config = CCMConfig()
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 16.0, 0.05)
    assert config.update == "concat" and config.conditional_lora and config.max_memory_tokens is None


@given(
    n=st.integers(1, 16),
    update=st.sampled_from(["concat", "merge", "ema"]),
    alpha=st.floats(0.01, 1.0),
    conditional=st.booleans(),
)
def test_json_round_trip(tmp_path_factory, n, update, alpha, conditional):
    config = CCMConfig(
        num_comp_tokens=n,
        update=update,
        ema_alpha=alpha,
        max_memory_tokens=4 * n if update == "concat" else None,
        conditional_lora=conditional,
        target_modules=["q_proj", "v_proj"],
        base_model_name_or_path="org/model",
    )
    folder = tmp_path_factory.mktemp("config")
    path = config.save_pretrained(folder)
    assert path.endswith(CONFIG_NAME)
    assert CCMConfig.from_pretrained(folder) == config
    assert json.loads(Path(path).read_text())["format_version"] == 1


INVALID = [
    ({"num_comp_tokens": 0}, "num_comp_tokens", "positive integer"),
    ({"update": "sum"}, "update", "'concat' | 'merge' | 'ema'"),
    ({"ema_alpha": 0.0}, "ema_alpha", "(0, 1]"),
    ({"ema_alpha": float("nan")}, "ema_alpha", "(0, 1]"),
    ({"ema_alpha": 1.5}, "ema_alpha", "(0, 1]"),
    ({"ema_alpha": True}, "ema_alpha", "(0, 1]"),
    ({"max_memory_tokens": 1, "num_comp_tokens": 2}, "max_memory_tokens", ">= num_comp_tokens"),
    ({"max_memory_tokens": 8, "update": "merge"}, "max_memory_tokens", "update='concat' only"),
    ({"max_memory_tokens": 2**63}, "max_memory_tokens", "< 2**63 (None for no cap)"),
    ({"r": -1}, "r", "positive integer"),
    ({"lora_alpha": float("inf")}, "lora_alpha", "positive finite number"),  # its LoRA gave NaN everywhere
    # Past float's range: the LoRA scaling alpha / r raised an OverflowError inside the wrapping of the model.
    ({"lora_alpha": 10**400}, "lora_alpha", "positive finite number"),
    ({"lora_dropout": 1.0}, "lora_dropout", "[0, 1)"),
    ({"conditional_lora": "yes"}, "conditional_lora", "True or False"),
    ({"target_modules": []}, "target_modules", "non-empty list"),
    ({"base_model_name_or_path": 5}, "base_model_name_or_path", "None or a string"),
    ({"base_model_revision": ["main"]}, "base_model_revision", "None or a string"),
    ({"trained_on": 3}, "trained_on", "None or a string"),
    ({"base_model_shape": [576]}, "base_model_shape", "object of sizes"),
]


@pytest.mark.parametrize(("kwargs", "field", "allowed"), INVALID)
def test_invalid_values_name_field_and_allowed_values(kwargs, field, allowed):
    with pytest.raises(ValueError, match=field) as error:
        CCMConfig(**kwargs)
    assert allowed in str(error.value)


@pytest.mark.parametrize(("kwargs", "field", "allowed"), INVALID)
def test_a_field_set_alone_is_checked_and_left_as_it_was(kwargs, field, allowed):
    """A field set after construction (`model.config.ema_alpha = 2.0`) skipped every check: EMA memory then grew without
    bound, and an unknown update rule folded as EMA."""
    config = CCMConfig(**{name: value for name, value in kwargs.items() if name != field})
    before = copy.deepcopy(config)
    with pytest.raises(ValueError, match=field) as error:
        setattr(config, field, kwargs[field])
    assert allowed in str(error.value)
    assert config == before


SETTINGS = {
    "num_comp_tokens": st.integers(-1, 4),
    "update": st.sampled_from(["concat", "merge", "ema", "mean"]),
    "ema_alpha": st.one_of(st.floats(allow_nan=True), st.integers(-1, 2), st.booleans()),
    "max_memory_tokens": st.one_of(st.none(), st.integers(-1, 6)),
    "target_modules": st.one_of(st.none(), st.lists(st.sampled_from(["q_proj", "v_proj"]), max_size=2).map(tuple)),
}


@given(changes=st.lists(st.sampled_from(sorted(SETTINGS)).flatmap(lambda f: st.tuples(st.just(f), SETTINGS[f]))))
def test_a_config_changed_field_by_field_stays_one_the_constructor_takes(changes):
    config = CCMConfig()
    for field, value in changes:
        with contextlib.suppress(ValueError):
            setattr(config, field, value)
        assert CCMConfig(**{f.name: getattr(config, f.name) for f in fields(CCMConfig)}) == config
    assert config.target_modules is None or isinstance(config.target_modules, list)


def test_unknown_format_version(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**CCMConfig().to_dict(), "format_version": 99}))
    with pytest.raises(ValueError, match=r"format_version 99.*Upgrade"):
        CCMConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("version", ["1", 1.0, None, True])
def test_a_format_version_that_is_no_whole_number_is_named(tmp_path, version):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**CCMConfig().to_dict(), "format_version": version}))
    with pytest.raises(ValueError, match=r"format_version .*must be a whole number"):
        CCMConfig.from_pretrained(tmp_path)


def test_unknown_field(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"num_comp_tokens": 2, "comp_len": 3}))
    with pytest.raises(ValueError, match="comp_len"):
        CCMConfig.from_pretrained(tmp_path)


def test_corrupt_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no CCM adapter"):
        CCMConfig.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        CCMConfig.from_pretrained(tmp_path)


def test_a_config_that_is_a_pipe_a_folder_or_too_large_is_refused_unread(tmp_path):
    """`ccm train --resume` reads a checkpoint's ccm_config.json: a named pipe there blocked for good (here a writer
    comes, and its config was taken), a folder failed with a bare IsADirectoryError, and a file of gigabytes was read
    whole before it was parsed."""
    path = tmp_path / CONFIG_NAME
    content = json.dumps(CCMConfig().to_dict())
    with pipe_feeding(path, content), pytest.raises(ValueError, match=rf"{path} is not a regular file"):
        CCMConfig.from_pretrained(tmp_path)
    path.unlink()
    path.mkdir()
    with pytest.raises(ValueError, match=rf"{path} is not a regular file .*; give the ccm_config\.json of an adapter"):
        CCMConfig.from_pretrained(tmp_path)
    path.rmdir()
    path.write_text(content + " " * CONFIG_MAX_BYTES)  # valid JSON, larger than any config
    with pytest.raises(ValueError, match=rf"{path} is larger than {CONFIG_MAX_BYTES} bytes"):
        CCMConfig.from_pretrained(tmp_path)
    path.write_text(content)
    assert CCMConfig.from_pretrained(tmp_path) == CCMConfig()


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 10**400) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from([f.name for f in fields(CCMConfig)]), _JSON_VALUES, max_size=3))
@example(changes={"lora_alpha": 10**400})  # past float's range: math.isfinite raised an OverflowError
def test_any_json_value_in_a_config_file_loads_or_is_refused_naming_file_and_field(tmp_path, changes):
    path = tmp_path / CONFIG_NAME
    path.write_text(json.dumps({**CCMConfig().to_dict(), **changes}))
    try:
        config = CCMConfig.from_pretrained(tmp_path)
    except ValueError as error:
        assert str(path) in str(error) and any(f"CCMConfig.{name}" in str(error) for name in changes), error
    else:
        assert all(getattr(config, name) == value for name, value in changes.items())


SHAPE = {"model_type": "llama", "hidden_size": 64, "rope": {"factors": [1.0, 2.0]}}
IN_PLACE = {
    "target_modules": [
        lambda v: v.append("o_proj"),
        lambda v: v.extend(["o_proj"]),
        lambda v: v.insert(0, "o_proj"),
        lambda v: v.remove("q_proj"),
        lambda v: v.pop(),
        lambda v: v.clear(),
        lambda v: v.sort(),
        lambda v: v.reverse(),
        lambda v: v.__setitem__(0, "o_proj"),
        lambda v: v.__delitem__(slice(0, 1)),
        lambda v: v.__imul__(2),
    ],
    "base_model_shape": [
        lambda v: v.__setitem__("hidden_size", 1),
        lambda v: v.__delitem__("hidden_size"),
        lambda v: v.update(hidden_size=1),
        lambda v: v.setdefault("vocab_size", 1),
        lambda v: v.pop("hidden_size"),
        lambda v: v.popitem(),
        lambda v: v.clear(),
        lambda v: v["rope"].__setitem__("factors", []),
        lambda v: v["rope"]["factors"].append(3.0),
    ],
}


@given(
    field_and_change=st.sampled_from(sorted(IN_PLACE)).flatmap(
        lambda f: st.tuples(st.just(f), st.sampled_from(IN_PLACE[f]))
    ),
    as_tuple=st.booleans(),
)
def test_a_list_or_dict_field_refuses_changes_in_place_and_stays_as_it_was(field_and_change, as_tuple):
    """`config.target_modules.append(...)` skipped every check of a field set alone, and the hold of a model on the
    fields it was built with; a config is changed by setting its fields."""
    field, change = field_and_change
    modules = ["q_proj", "v_proj"]
    config = CCMConfig(target_modules=tuple(modules) if as_tuple else modules, base_model_shape=copy.deepcopy(SHAPE))
    before = copy.deepcopy(config)
    with pytest.raises(TypeError, match=r"cannot change in place.*set the field"):
        change(getattr(config, field))
    assert config == before and config.target_modules == modules and config.base_model_shape == SHAPE
    for each in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):  # a copy refuses them too
        assert each == config
        with pytest.raises(TypeError, match="cannot change in place"):
            change(getattr(each, field))


def test_a_list_or_dict_field_is_set_checked_and_written_as_before(tmp_path):
    """Held as lists and dicts that refuse changes in place, the fields read, compare, and are written to JSON byte for
    byte as plain ones."""
    config = CCMConfig(target_modules=["q_proj", "v_proj"], base_model_shape=copy.deepcopy(SHAPE))
    assert config == CCMConfig(target_modules=("q_proj", "v_proj"), base_model_shape=SHAPE)
    with pytest.raises(ValueError, match="target_modules"):  # `+=` sets the field, which is checked
        config.target_modules += [3]
    config.target_modules += ["o_proj"]
    config.base_model_shape |= {"vocab_size": 10}
    assert config.target_modules == ["q_proj", "v_proj", "o_proj"]
    assert config.base_model_shape == {**SHAPE, "vocab_size": 10}
    expected = {field.name: field.default for field in fields(CCMConfig)}
    expected |= {"target_modules": ["q_proj", "v_proj", "o_proj"], "base_model_shape": {**SHAPE, "vocab_size": 10}}
    expected = {"format_version": 1, "ccm_version": __version__, **expected}
    content = config.to_dict()
    assert content == expected
    assert type(content["target_modules"]) is list and type(content["base_model_shape"]["rope"]) is dict
    assert Path(config.save_pretrained(tmp_path)).read_text() == json.dumps(expected, indent=2, sort_keys=True) + "\n"
    assert CCMConfig.from_pretrained(tmp_path) == config
