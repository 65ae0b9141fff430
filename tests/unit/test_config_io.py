"""The YAML/override -> typed config tree loader."""

from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple

import pytest

from megatron_rl.config_io import ConfigError, build, load_yaml, merge, parse_overrides, to_dict


@dataclass(frozen=True)
class Inner:
    lr: float = 1e-3
    kind: Literal["constant", "cosine"] = "constant"
    steps: Optional[int] = None

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")


@dataclass
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)
    ids: Tuple[int, ...] = ()
    flag: bool = False


def test_build_nested_with_overrides(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: run\ninner:\n  lr: 1e-4\n  kind: cosine\nids: [1, 2]\n")
    data = merge(load_yaml(p), parse_overrides(["inner.steps=10", "flag=true", "inner.lr=2e-4"]))
    cfg = build(Outer, data)
    assert cfg == Outer("run", Inner(2e-4, "cosine", 10), (1, 2), True)
    assert to_dict(cfg) == {"name": "run", "inner": {"lr": 2e-4, "kind": "cosine", "steps": 10}, "ids": [1, 2],
                            "flag": True}


@pytest.mark.parametrize("data,match", [
    ({"name": "x", "inner": {"lrr": 1}}, r"Outer.inner.lrr: unknown field; did you mean 'lr'\?"),
    ({"name": "x", "inner": {"kind": "linear"}}, r"Outer.inner.kind='linear': expected one of \['constant', 'cosine'\]"),
    ({"name": "x", "inner": {"steps": 1.5}}, r"Outer.inner.steps=1.5: expected an integer"),
    ({"name": "x", "flag": "yes"}, r"Outer.flag='yes': expected true or false"),
    ({"name": "x", "inner": {"lr": -1}}, r"Outer.inner: lr=-1.0 must be > 0"),
    ({"inner": {}}, r"Outer: missing required field\(s\) \['name'\]"),
    ({"name": "x", "ids": 3}, r"Outer.ids=3: expected a list"),
])
def test_errors_name_the_path_value_and_expectation(data, match):
    with pytest.raises(ConfigError, match=match):
        build(Outer, data)


def test_override_syntax_and_missing_recipe(tmp_path):
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        parse_overrides(["inner.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml")
    assert parse_overrides(["a.b=[1, 2]", "a.c=x"]) == {"a": {"b": [1, 2], "c": "x"}}
