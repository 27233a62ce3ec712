"""The raw request of ``dwdp.operator.kube`` (``api_request``), over a fake ``ApiClient``: the
JSON body, an open response when streamed, and ``ApiError`` naming the Status's message."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from dwdp.operator.kube import REQUEST_TIMEOUT_S, ApiError, api_request


@dataclass
class _Raw:
    data: bytes
    released: bool = False

    def release_conn(self) -> None:
        self.released = True


@dataclass
class _Answer:
    status: int
    reason: str
    response: _Raw


@dataclass
class FakeClient:
    """The two calls of ``kubernetes.client.ApiClient`` that ``api_request`` makes."""

    status: int = 200
    data: bytes = b""
    reason: str = "OK"
    calls: list[dict[str, Any]] = field(default_factory=list)
    raw: _Raw | None = None

    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple:
        self.calls.append({"method": method, "path": path, **kwargs})
        return method, "https://api" + path, kwargs["header_params"], kwargs["body"], None

    def call_api(self, method: str, url: str, **kwargs: Any) -> _Answer:
        self.calls[-1]["timeout"] = kwargs["_request_timeout"]
        self.raw = _Raw(self.data)
        return _Answer(self.status, self.reason, self.raw)


def test_a_2xx_answer_is_its_decoded_json_and_the_connection_goes_back() -> None:
    client = FakeClient(data=b'{"kind": "Pod"}')
    got = api_request(client, "PATCH", "/api/v1/x", {"a": 1}, {"force": "true"},
                      "application/apply-patch+yaml")
    assert got == {"kind": "Pod"}
    assert client.raw is not None and client.raw.released
    call = client.calls[0]
    assert call["query_params"] == [("force", "true")] and call["body"] == {"a": 1}
    assert call["header_params"]["Content-Type"] == "application/apply-patch+yaml"
    assert call["timeout"] == REQUEST_TIMEOUT_S
    assert api_request(FakeClient(data=b""), "DELETE", "/api/v1/x") is None


def test_a_streamed_2xx_answer_is_the_open_response() -> None:
    client = FakeClient(data=b'{"type": "ADDED"}\n')
    got = api_request(client, "GET", "/api/v1/pods", stream=True, timeout=None)
    assert got is client.raw and not got.released
    assert client.calls[0]["timeout"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_non_2xx_answer_raises_api_error_with_the_status_message(stream: bool) -> None:
    status = {"kind": "Status", "code": 404, "message": 'pods "p" not found'}
    client = FakeClient(status=404, data=json.dumps(status).encode(), reason="Not Found")
    with pytest.raises(ApiError) as caught:
        api_request(client, "GET", "/api/v1/namespaces/n/pods/p", stream=stream)
    assert (caught.value.status, caught.value.message) == (404, 'pods "p" not found')
    assert str(caught.value) == '404: pods "p" not found'
    assert client.raw is not None and client.raw.released


def test_a_non_2xx_answer_without_a_status_names_its_body_or_reason() -> None:
    with pytest.raises(ApiError, match=r"^502: bad gateway$"):
        api_request(FakeClient(status=502, data=b"bad gateway"), "GET", "/x")
    with pytest.raises(ApiError, match=r"^503: Service Unavailable$"):
        api_request(FakeClient(status=503, reason="Service Unavailable"), "GET", "/x")
