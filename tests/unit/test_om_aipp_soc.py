"""AIPP inputs and the SoC an `.om` was compiled for, read offline: the reader, the servability checks and `geserve inspect`."""

from __future__ import annotations

from pathlib import Path

import pytest

from geserve.atc.chips import family
from geserve.backends.acl.description import OmTensor, check_servable, resolve_input_dims
from geserve.backends.acl.om_file import describe_bytes
from geserve.backends.acl.soc import check_soc, read_before_load
from geserve.cli import main
from geserve.errors import ModelLoadError
from tests.fakes.om_models import affine_description, aipp_description, dynamic_aipp_description
from tests.fakes.om_writer import om2_bytes, om_bytes, write_om

UINT8 = 4


@pytest.mark.parametrize("source", ["records", "graph", "om2"])
def test_a_static_aipp_input_is_described_by_the_dims_its_size_has(source: str) -> None:
    description = aipp_description(height=16, width=16)
    data = om2_bytes(description) if source == "om2" else om_bytes(description, inout_info=source == "records")
    om = describe_bytes(data)
    (image,) = om.inputs
    # YUV420SP_U8: the image is n,h,w,c; the buffer is n,h*1.5,w,1 bytes (aclmdlGetInputDimsV2).
    assert image.dims == (1, 24, 16, 1)
    assert image.dims_v1 == (1, 16, 16, 3) and image.dims_v2 == (1, 24, 16, 1)
    if source != "om2":  # OM2 entries written here carry no size
        assert image.size == 24 * 16
    assert om.to_json()["inputs"][0]["dims"] == [1, 24, 16, 1]
    check_servable(om, "aipp", "aipp.om")


def test_inputs_without_aipp_keep_their_dims_and_record_no_second_set() -> None:
    for data in (om_bytes(affine_description([1, 2, 4, 8])), om2_bytes(affine_description([1, 2, 4, 8]))):
        (x,) = describe_bytes(data).inputs
        assert x.dims == (-1, 4) and x.dims_v1 == () and x.dims_v2 == ()


def test_the_dims_that_match_the_size_are_served_whichever_call_gives_them() -> None:
    image = OmTensor("image", 0, UINT8, (1, 16, 16, 3), 768, "NHWC", dims_v2=(1, 24, 16, 1))
    assert resolve_input_dims(image, 0).dims == (1, 16, 16, 3)  # the size is the image's
    image = OmTensor("image", 0, UINT8, (-1, 16, 16, 3), 8 * 384, "NHWC", dims_v2=(-1, 24, 16, 1))
    assert resolve_input_dims(image, 8).dims == (-1, 24, 16, 1)  # at the largest gear


def test_an_input_that_neither_dims_describe_is_refused_naming_it_its_dims_and_size() -> None:
    om = describe_bytes(om_bytes(aipp_description()))
    (image,) = om.inputs
    odd = resolve_input_dims(OmTensor("image", 0, UINT8, image.dims_v1, 500, "NHWC", dims_v2=image.dims_v2), 0)
    with pytest.raises(ModelLoadError) as error:
        check_servable(type(om)((odd,), om.outputs, name=om.name), "aipp", "aipp.om")
    message = error.value.message
    assert "model 'aipp': 'aipp.om': input 'image' is 500 bytes" in message
    assert "[1, 16, 16, 3] (aclmdlGetInputDims)" in message and "[1, 24, 16, 1] (aclmdlGetInputDimsV2" in message


def test_a_dynamic_aipp_model_is_refused_saying_why() -> None:
    om = describe_bytes(om_bytes(dynamic_aipp_description()))
    with pytest.raises(ModelLoadError) as error:
        check_servable(om, "dyn", "dyn.om")
    assert "model 'dyn': 'dyn.om': dynamic AIPP is not supported:" in error.value.message
    assert "'ascend_dynamic_aipp_data' input" in error.value.message
    assert "static AIPP" in error.value.message


def test_inspect_shows_the_buffer_dims_the_image_dims_the_soc_and_a_config_of_the_buffer_dims(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_om(tmp_path / "aipp.om", aipp_description(soc_version="Ascend910B3"))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "soc: Ascend910B3" in out
    assert "0: image  uint8  [1, 24, 16, 1]  NHWC  (static AIPP: the image is [1, 16, 16, 3]" in out
    assert "data_type: TYPE_UINT8" in out and "dims: 24" in out and "dims: 16" in out and "dims: 1\n" in out


def test_inspect_says_a_dynamic_aipp_model_is_not_servable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_om(tmp_path / "dyn.om", dynamic_aipp_description())
    assert main(["inspect", str(path)]) == 1
    assert "not servable by geserve:" in capsys.readouterr().out


def test_a_file_compiled_for_another_architecture_is_refused_naming_both_chips_and_the_fix(tmp_path: Path) -> None:
    path = write_om(tmp_path / "model.om", affine_description(static_batch=1))  # records Ascend310P3
    with pytest.raises(ModelLoadError) as error:
        check_soc("affine", str(path), "Ascend910B3", read_before_load(str(path)))
    assert error.value.message == (
        f"model 'affine': '{path}' was compiled for Ascend310P3, this host is Ascend910B3: Ascend310P3 is an "
        "Ascend310P chip and Ascend910B3 an Ascend910B one, and the runtime loads an .om only on a chip of the "
        "architecture it was compiled for; compile it again with ATC --soc_version=Ascend910B3"
    )
    check_soc("affine", str(path), "Ascend310P3", read_before_load(str(path)))
    check_soc("affine", str(path), "", read_before_load(str(path)))  # the host's SoC unknown: the runtime has its say


@pytest.mark.parametrize(("compiled_for", "host"), [("Ascend310P3", "Ascend310P1"), ("Ascend910B3", "Ascend910_9391")])
def test_a_file_compiled_for_another_chip_of_the_family_loads_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, compiled_for: str, host: str
) -> None:
    description = affine_description(static_batch=1)
    description["soc_version"] = compiled_for
    path = write_om(tmp_path / "model.om", description)
    check_soc("affine", str(path), host, read_before_load(str(path)))
    (record,) = [record for record in caplog.records if record.name == "geserve.backends.acl.soc"]
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        f"model 'affine': '{path}' was compiled for {compiled_for}, this host is {host}: both are "
        f"{family(host)} chips (one architecture), so the runtime loads it; to have a file made for this chip, "
        f"compile it again with ATC --soc_version={host}"
    )
    caplog.clear()
    check_soc("affine", str(path), compiled_for, read_before_load(str(path)))  # the same chip: nothing to say
    assert not caplog.records


@pytest.mark.parametrize(
    ("compiled_for", "host", "unknown"),
    [("Ascend310", "Ascend310P3", "Ascend310"), ("Ascend310P3", "Ascend999", "Ascend999")],
)
def test_a_chip_geserve_does_not_know_takes_only_a_file_made_for_itself(
    tmp_path: Path, compiled_for: str, host: str, unknown: str
) -> None:
    description = affine_description(static_batch=1)
    description["soc_version"] = compiled_for
    path = write_om(tmp_path / "model.om", description)
    with pytest.raises(ModelLoadError) as error:
        check_soc("affine", str(path), host, read_before_load(str(path)))
    assert error.value.message == (
        f"model 'affine': '{path}' was compiled for {compiled_for}, this host is {host}: the runtime loads an .om "
        "only on a chip of the architecture it was compiled for, and geserve does not know the architecture of "
        f"{unknown}, so it takes only the same chip; compile it again with ATC --soc_version={host}"
    )
    check_soc("affine", str(path), compiled_for, read_before_load(str(path)))


def test_a_file_that_records_no_soc_or_cannot_be_read_here_is_left_to_the_runtime(tmp_path: Path) -> None:
    description = affine_description(static_batch=1)
    description["soc_version"] = None
    none = str(write_om(tmp_path / "none.om", description))
    check_soc("affine", none, "Ascend910B3", read_before_load(none))
    (tmp_path / "odd.om").write_bytes(b"not an om file at all")
    assert read_before_load(str(tmp_path / "odd.om")) is None
    check_soc("affine", str(tmp_path / "odd.om"), "Ascend910B3", None)
