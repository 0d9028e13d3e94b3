"""geserve's OpenAPI document holds KServe's v2 REST spec: every path and method, with compatible bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from geserve.http.app import create_api
from geserve.http.openapi import ROUTES
from tests.support import ROOT

KSERVE_SPEC = ROOT / "tests" / "data" / "kserve" / "rest_predict_v2.yaml"
# KServe writes path parameters as ${NAME}; Triton's routes, and geserve's, name them so.
KSERVE_PARAMETERS = {"${MODEL_NAME}": "{model_name}", "${MODEL_VERSION}": "{version}"}


class _NoService:
    """The document is built from the routes alone; no route is called here."""


def _ours() -> dict[str, Any]:
    return create_api(_NoService()).openapi()  # type: ignore[arg-type]


def _theirs() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(Path(KSERVE_SPEC).read_text())
    return spec


def _our_path(kserve_path: str) -> str:
    for theirs, ours in KSERVE_PARAMETERS.items():
        kserve_path = kserve_path.replace(theirs, ours)
    # KServe lists server metadata as /v2/; Triton (and so geserve) answers it at /v2, as KServe's own servers do.
    return kserve_path.rstrip("/")


def _resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = document["components"]["schemas"][name]
    return schema


def _branches(document: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives a schema allows, references resolved and `null` (an optional member) left out."""
    schema = _resolve(document, schema)
    if "anyOf" in schema:
        return [
            branch
            for option in schema["anyOf"]
            for branch in _branches(document, option)
            if branch.get("type") != "null"
        ]
    return [schema]


def _compatible(theirs: dict[str, Any], ours: dict[str, Any], their_doc: dict[str, Any], our_doc: dict[str, Any], depth: int = 0) -> list[str]:  # fmt: skip
    """Why a value of KServe's schema would not fit ours (and so, for a response, ours not fit theirs), by type."""
    our_options = _branches(our_doc, ours)
    if depth > 6 or any("type" not in option for option in our_options):
        return []  # ours takes any value here
    problems = []
    for their_option in _branches(their_doc, theirs):
        kind = their_option.get("type")
        if kind is None:
            continue
        matching = [o for o in our_options if o["type"] == kind or {o["type"], kind} == {"number", "integer"}]
        if not matching:
            problems.append(f"KServe's {kind} is none of {[o['type'] for o in our_options]}")
            continue
        ours_match = matching[0]
        if kind == "array":
            problems += _compatible(their_option.get("items", {}), ours_match.get("items", {}), their_doc, our_doc, depth + 1)  # fmt: skip
        elif kind == "object":
            our_properties = ours_match.get("properties", {})
            for name, their_property in their_option.get("properties", {}).items():
                if name not in our_properties:
                    if ours_match.get("additionalProperties") is False:
                        problems.append(f"member '{name}' is not allowed")
                    continue
                for problem in _compatible(their_property, our_properties[name], their_doc, our_doc, depth + 1):
                    problems.append(f"'{name}': {problem}")
    return problems


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if method in ("get", "post")
    ]


@pytest.mark.parametrize(("method", "path"), [(m, p) for m, p, _ in _operations(_theirs())])
def test_every_kserve_path_and_method_is_in_geserves_document(method: str, path: str) -> None:
    ours = _ours()
    assert _our_path(path) in ours["paths"], sorted(ours["paths"])
    assert method in ours["paths"][_our_path(path)]


@pytest.mark.parametrize(("method", "path"), [(m, p) for m, p, _ in _operations(_theirs())])
def test_bodies_are_compatible_with_kserves(method: str, path: str) -> None:
    theirs, ours = _theirs(), _ours()
    their_operation = theirs["paths"][path][method]
    our_operation = ours["paths"][_our_path(path)][method]
    if "requestBody" in their_operation:
        their_body = their_operation["requestBody"]["content"]["application/json"]["schema"]
        our_body = our_operation["requestBody"]["content"]["application/json"]["schema"]
        assert _compatible(their_body, our_body, theirs, ours) == []
        # A request KServe's spec allows must be one geserve's allows: nothing more may be required.
        their_required = set(_resolve(theirs, their_body).get("required", []))
        assert set(_resolve(ours, our_body).get("required", [])) <= their_required
    their_ok = their_operation["responses"]["200"].get("content", {}).get("application/json")
    if their_ok is not None:
        our_ok = our_operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert _compatible(their_ok["schema"], our_ok, theirs, ours) == []
        # What a KServe client may rely on in an answer is there, by name.
        their_required = set(_resolve(theirs, their_ok["schema"]).get("required", []))
        assert their_required <= set(_resolve(ours, our_ok).get("properties", {}))


def test_the_comparison_catches_a_drift() -> None:
    """The checks above fail on a document that no longer holds KServe's: a member of the wrong type."""
    theirs, ours = _theirs(), _ours()
    ours["components"]["schemas"]["InferenceResponse"]["properties"]["model_name"] = {"type": "integer"}
    their_ok = theirs["paths"]["/v2/models/${MODEL_NAME}/versions/${MODEL_VERSION}/infer"]["post"]["responses"]["200"]
    our_ok = {"$ref": "#/components/schemas/InferenceResponse"}
    assert _compatible(their_ok["content"]["application/json"]["schema"], our_ok, theirs, ours) == [
        "'model_name': KServe's string is none of ['integer']"
    ]


def test_every_route_geserve_serves_is_documented_with_its_path_parameters() -> None:
    ours = _ours()
    for method, path in ROUTES:
        operation = ours["paths"][path][method.lower()]
        named = {parameter["name"] for parameter in operation.get("parameters", [])}
        assert named == {part[1:-1] for part in path.split("/") if part.startswith("{")}, (method, path)
        assert "400" in operation["responses"]
