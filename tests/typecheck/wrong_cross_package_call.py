"""A deliberately wrong call across packages, which the type checker must refuse.

Not part of the checked tree (mypy checks the package ``dwdp`` under src/; this file lives
under tests/ and is never imported): ``tests/unit/test_typecheck.py`` feeds it to mypy with
the project's configuration and expects exactly the errors marked ``# expect:`` below. It is
the kind of drift a checker catches between the operator and the API: a count read from
YAML as text, and a result used as the wrong type.
"""

from dwdp.api.partition import expert_partition

table = expert_partition("128", 4)  # expect: arg-type
first_range: str = table.ranges[0]  # expect: assignment
