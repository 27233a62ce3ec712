"""The process kubelet's API client (``dwdp_dev.devcluster.kubelet.Api``) sends through the
operator's ``api_request``: the same ``ApiError``, and ``ApiUnreachable`` when no answer
comes."""

from __future__ import annotations

from typing import Any

import pytest

from dwdp.operator import kube
from dwdp_dev.devcluster import kubelet


class _Client:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple:
        return method, path, kwargs["header_params"], kwargs["body"], None

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        assert self.error is not None
        raise self.error


def _api(client: _Client) -> kubelet.Api:
    api = object.__new__(kubelet.Api)  # no kubeconfig: the client is the fake
    api.client = client
    return api


def test_the_kubelet_raises_the_operators_api_error() -> None:
    assert kubelet.ApiError is kube.ApiError


def test_no_answer_is_api_unreachable_an_api_error_of_status_0() -> None:
    with pytest.raises(kubelet.ApiUnreachable) as caught:
        _api(_Client(ConnectionRefusedError("refused"))).get("/api/v1/nodes")
    assert isinstance(caught.value, kube.ApiError) and caught.value.status == 0
    assert "apiserver unreachable: refused" in str(caught.value)
