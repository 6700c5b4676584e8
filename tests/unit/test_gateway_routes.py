"""The gateway's route table (zml_gateway.routes): exact paths, templates, methods, Allow."""

from __future__ import annotations

from typing import Any

import pytest

from zml_gateway.routes import Routes


async def h1(scope: Any, receive: Any, send: Any) -> None:
    pass


async def h2(scope: Any, receive: Any, send: Any) -> None:
    pass


def table() -> Routes:
    r = Routes()
    r.add("POST", "/v1/chat/completions", h1)
    r.add("GET", "/v1/models", h1)
    r.add("GET", "/v1/models/{model:path}", h2)
    r.add("GET", "/v1/files", h1)
    r.add("POST", "/v1/files", h2)
    r.add("GET", "/v1/files/{file_id}", h1)
    r.add("GET", "/v1/files/{file_id}/content", h2)
    r.add("POST", "/v1/batches/{batch_id}/cancel", h1)
    return r


def test_an_exact_path_is_found_with_its_methods() -> None:
    assert table().match("/v1/chat/completions") == ({"POST": h1}, None)
    assert table().match("/v1/files") == ({"GET": h1, "POST": h2}, None)


def test_a_path_parameter_takes_the_rest_slashes_included() -> None:
    r = table()
    assert r.match("/v1/models/meta-llama/Llama-3.1-8B-Instruct") == (
        {"GET": h2}, {"model": "meta-llama/Llama-3.1-8B-Instruct"})
    assert r.match("/v1/models/") == ({"GET": h2}, {"model": ""})  # model_object answers 404 for ""
    assert r.match("/v1/models") == ({"GET": h1}, None)  # the exact path, not the template


def test_a_segment_parameter_is_one_non_empty_segment() -> None:
    r = table()
    assert r.match("/v1/files/file-1") == ({"GET": h1}, {"file_id": "file-1"})
    assert r.match("/v1/files/file-1/content") == ({"GET": h2}, {"file_id": "file-1"})
    assert r.match("/v1/batches/b1/cancel") == ({"POST": h1}, {"batch_id": "b1"})
    for path in ("/v1/files//content", "/v1/files/a/b", "/v1/files/file-1/contents", "/v1/batches/b1",
                 "/v1/chat/completions/", "/nope", "", "/"):
        assert r.match(path) is None, path


def test_allow_lists_the_methods_of_the_path() -> None:
    r = table()
    assert r.allow("/v1/chat/completions") == "POST"
    assert r.allow("/v1/files") == "GET, POST"
    assert r.allow("/v1/models/x") == "GET"


def test_a_route_is_added_once_and_templates_are_checked() -> None:
    r = table()
    with pytest.raises(ValueError, match="already"):
        r.add("GET", "/v1/models", h2)
    with pytest.raises(ValueError, match="last"):
        r.add("GET", "/v1/{rest:path}/x", h1)
    with pytest.raises(ValueError, match="kind"):
        r.add("GET", "/v1/{n:int}", h1)
    assert r.paths()[:2] == ["/v1/chat/completions", "/v1/models"]
