"""ATC's output names split into the names a config may use, ONNX names holding `:` included."""

from __future__ import annotations

import pytest

from geserve.backends.acl import names
from geserve.errors import ModelLoadError


@pytest.mark.parametrize(
    ("full", "short"),
    [
        ("prob_node:0:prob", "prob"),
        # tf2onnx names every output `<op>:<index>`; ATC keeps that whole after its own `<node>:<index>:`
        ("Identity_node:0:Identity:0", "Identity:0"),
        ("PartitionedCall/Identity_1:3:Identity_1:0", "Identity_1:0"),
        ("StatefulPartitionedCall/model/dense/BiasAdd:0:dense:12:out", "dense:12:out"),
        ("dense/Softmax:0", "dense/Softmax"),
        ("generation/output:0", "generation/output"),
        ("output_0_add_1", None),
    ],
)
def test_a_three_part_name_splits_at_its_first_index(full: str, short: str | None) -> None:
    assert names.short_name(full) == short


def test_a_config_naming_a_tf2onnx_output_resolves_to_the_atc_name() -> None:
    full_names = ["Identity_node:0:Identity:0", "Identity_1_node:0:Identity_1:0"]
    assert names.resolve("Identity:0", full_names, "m", "model.om") == "Identity_node:0:Identity:0"
    assert names.resolve("Identity_1:0", full_names, "m", "model.om") == "Identity_1_node:0:Identity_1:0"
    assert names.shortest_unique(full_names) == ["Identity:0", "Identity_1:0"]
    with pytest.raises(ModelLoadError, match=r"config output 'Identity' is not in 'model.om'"):
        names.resolve("Identity", full_names, "m", "model.om")
