"""The REST API's OpenAPI contract, served: /openapi.json and /docs, off with --http-openapi=false, restricted as
the metadata group of --http-restricted-api, and the routes it documents answering as before."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
import tritonclient.http as httpclient

from tests.support import MODEL_REPOSITORY, GeserveProcess

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers.get("content-type", "")
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read(), error.headers.get("content-type", "")


def test_the_document_and_its_browsable_form_are_served(server: GeserveProcess) -> None:
    status, body, kind = _get(f"http://{server.url}/openapi.json")
    assert status == 200 and kind.startswith("application/json")
    document = json.loads(body)
    assert document["openapi"].startswith("3.")
    assert "/v2/models/{model_name}/versions/{version}/infer" in document["paths"]
    assert "/v2/repository/index" in document["paths"]
    status, body, kind = _get(f"http://{server.url}/docs")
    assert status == 200 and kind.startswith("text/html") and b"/openapi.json" in body
    # The routes it documents answer as they always have (Triton's error bodies included).
    client = httpclient.InferenceServerClient(server.url)
    assert client.is_server_live() and client.get_server_metadata()["name"] == "triton"
    status, body, _ = _get(f"http://{server.url}/v2/models/no_such_model")
    assert status == 400 and "error" in json.loads(body)


def test_the_document_is_off_with_its_flag_and_restricted_with_the_metadata_group(launch: Launch) -> None:
    off = launch(f"--model-repository={MODEL_REPOSITORY}", "--http-openapi=false").wait_live()
    for path in ("/openapi.json", "/docs"):
        assert _get(f"http://{off.url}{path}")[0] == 404
    assert httpclient.InferenceServerClient(off.url).is_server_ready()
    assert off.stop() == 0
    restricted = launch(
        f"--model-repository={MODEL_REPOSITORY}", "--http-restricted-api=metadata:api-key=s3cret"
    ).wait_live()
    status, body, _ = _get(f"http://{restricted.url}/openapi.json")
    assert status == 403 and json.loads(body) == {"error": "This API is restricted, expecting header 'api-key'"}
    assert _get(f"http://{restricted.url}/openapi.json", {"api-key": "s3cret"})[0] == 200
    assert restricted.stop() == 0
