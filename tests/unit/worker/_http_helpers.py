"""HTTP helpers of the worker unit tests (imported by path, like tests/mp's helpers: a
conftest.py here would shadow tests/mp/conftest.py, which tests import by name)."""

from __future__ import annotations

import pytest

from dwdp_dev.worker.servers import UvicornThread  # noqa: F401  (the tests' import)


def schemathesis_run(
    base: str, headers: dict[str, str] | None = None, examples: int = 25
) -> tuple[dict[str, set[int]], list[tuple]]:
    """Schemathesis over every operation of the app at ``base`` (its OpenAPI document),
    ``examples`` cases each, with ``headers`` on every call; returns the status codes seen
    per path and the cases answered with a 5xx (path, body, status, text)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(base + "/openapi.json")  # the document is open
    failures: list[tuple] = []
    seen: dict[str, set[int]] = {}
    operations = [op.ok() for op in schema.get_all_operations()]

    def make_check(op):
        @given(case=op.as_strategy())
        @settings(
            max_examples=examples,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case):
            body = case.body if isinstance(case.body, dict) else None
            if body is not None and isinstance(body.get("max_tokens"), int):
                body["max_tokens"] = min(body["max_tokens"], 4)  # keep the run short
            response = case.call(base_url=base, headers=headers or {}, timeout=60)
            seen.setdefault(op.path, set()).add(response.status_code)
            if response.status_code >= 500:
                failures.append((op.path, case.body, response.status_code, response.text[:300]))

        return check

    for op in operations:
        make_check(op)()
    return seen, failures
