"""Build the ONNX models of model_repository/ (simple, simple_string, digits and the sequence models) from scratch."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
# Versions every supported onnxruntime release loads.
IR_VERSION = 9
OPSET = 17


def _save(model: onnx.ModelProto, path: Path) -> None:
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString(deterministic=True))


def _add_sub_graph(name: str, element_type: int, as_strings: bool) -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 over [batch, 16] tensors."""
    shape: list[str | int] = ["batch", 16]
    inputs = [helper.make_tensor_value_info(n, element_type, shape) for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, element_type, shape) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = []
    left, right = "INPUT0", "INPUT1"
    if as_strings:  # decimal strings in and out, integer arithmetic in between
        nodes += [
            helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
            helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
        ]
        left, right = "a", "b"
    sums, differences = ("sum", "difference") if as_strings else ("OUTPUT0", "OUTPUT1")
    nodes += [
        helper.make_node("Add", [left, right], [sums]),
        helper.make_node("Sub", [left, right], [differences]),
    ]
    if as_strings:
        nodes += [
            helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
            helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=TensorProto.STRING),
        ]
    graph = helper.make_graph(nodes, name, inputs, outputs)
    return helper.make_model(
        graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="geserve"
    )


def build_simple(repository: Path) -> None:
    _save(_add_sub_graph("simple", TensorProto.INT32, as_strings=False), repository / "simple" / "1" / "model.onnx")


def build_simple_string(repository: Path) -> None:
    model = _add_sub_graph("simple_string", TensorProto.STRING, as_strings=True)
    _save(model, repository / "simple_string" / "1" / "model.onnx")


def _model(
    name: str, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs)
    return helper.make_model(
        graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="geserve"
    )


def _column(name: str, element_type: int) -> onnx.ValueInfoProto:
    """A [batch, 1] tensor: one value per sequence request."""
    return helper.make_tensor_value_info(name, element_type, ["batch", 1])


def build_simple_sequence(repository: Path) -> None:
    """OUTPUT = READY * (INPUT + START): the sequence batcher fills START and READY."""
    nodes = [
        helper.make_node("Add", ["INPUT", "START"], ["sum"]),
        helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"]),
    ]
    inputs = [_column(n, TensorProto.INT32) for n in ("INPUT", "START", "READY")]
    model = _model("simple_sequence", nodes, inputs, [_column("OUTPUT", TensorProto.INT32)])
    _save(model, repository / "simple_sequence" / "1" / "model.onnx")


def build_sequence_controls(repository: Path) -> None:
    """All four controls, each in its own encoding: START int32, END fp32, READY bool, CORRID uint64.
    OUTPUT = READY * (INPUT + START + 2 * END); CORRID_OUT echoes the sequence id."""
    nodes = [
        helper.make_node("Cast", ["END"], ["end"], to=TensorProto.INT32),
        helper.make_node("Cast", ["READY"], ["ready"], to=TensorProto.INT32),
        helper.make_node("Add", ["end", "end"], ["twice_end"]),
        helper.make_node("Add", ["INPUT", "START"], ["started"]),
        helper.make_node("Add", ["started", "twice_end"], ["sum"]),
        helper.make_node("Mul", ["ready", "sum"], ["OUTPUT"]),
        helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"]),
    ]
    inputs = [
        _column("INPUT", TensorProto.INT32),
        _column("START", TensorProto.INT32),
        _column("END", TensorProto.FLOAT),
        _column("READY", TensorProto.BOOL),
        _column("CORRID", TensorProto.UINT64),
    ]
    outputs = [_column("OUTPUT", TensorProto.INT32), _column("CORRID_OUT", TensorProto.UINT64)]
    _save(_model("sequence_controls", nodes, inputs, outputs), repository / "sequence_controls" / "1" / "model.onnx")


def build_sequence_accumulator(repository: Path) -> None:
    """Implicit state: OUTPUT_STATE = INPUT_STATE + INPUT, and OUTPUT is that running sum."""
    nodes = [
        helper.make_node("Add", ["INPUT_STATE", "INPUT"], ["OUTPUT_STATE"]),
        helper.make_node("Identity", ["OUTPUT_STATE"], ["OUTPUT"]),
    ]
    inputs = [_column("INPUT", TensorProto.INT32), _column("INPUT_STATE", TensorProto.INT32)]
    outputs = [_column("OUTPUT", TensorProto.INT32), _column("OUTPUT_STATE", TensorProto.INT32)]
    model = _model("sequence_accumulator", nodes, inputs, outputs)
    _save(model, repository / "sequence_accumulator" / "1" / "model.onnx")


def build_digits(repository: Path) -> float:
    """Train a classifier on scikit-learn's bundled 8x8 digits; returns its held-out accuracy."""
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.float32), digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )
    classifier = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    classifier.fit(x_train, y_train)
    accuracy = float(classifier.score(x_test, y_test))
    model = convert_sklearn(
        classifier,
        name="digits",  # skl2onnx names an unnamed graph with a fresh uuid, which `make models` would rewrite each run
        initial_types=[("pixels", FloatTensorType([None, 64]))],
        options={LogisticRegression: {"zipmap": False}},
        target_opset={"": OPSET, "ai.onnx.ml": 3},
    )
    model.ir_version = IR_VERSION
    # Serve only the class probabilities; the label is their argmax.
    kept = [output for output in model.graph.output if output.name == "probabilities"]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    # Like the models above: geserve made the file; the converter's version is not geserve's.
    model.producer_name = "geserve"
    model.producer_version = ""
    _save(model, repository / "digits" / "1" / "model.onnx")
    np.save(repository / "digits" / "sample_digit.npy", x_test[:1])
    (repository / "digits" / "sample_label.txt").write_text(f"{int(y_test[0])}\n")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args()
    build_simple(args.repository)
    build_simple_string(args.repository)
    build_simple_sequence(args.repository)
    build_sequence_controls(args.repository)
    build_sequence_accumulator(args.repository)
    accuracy = build_digits(args.repository)
    print(f"digits: held-out accuracy {accuracy:.4f} on 25% of scikit-learn's digits data set")


if __name__ == "__main__":
    main()
