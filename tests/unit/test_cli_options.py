"""The ``dwdp`` command line refuses a bad global or port option with argparse's usage error
(exit status 2, the option and the value named), never a traceback."""

from __future__ import annotations

import pytest

from dwdp.cli import main


@pytest.mark.parametrize("argv", [
    ["worker", "--port", "70000"],
    ["launch", "--port", "0"],
    ["router-gate", "--host", "127.0.0.1", "--port", "70000", "--", "vllm-router"],
    ["worker", "--port", "http"],
])
def test_a_port_outside_1_to_65535_is_a_usage_error(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    value = argv[argv.index("--port") + 1]
    assert "argument --port: " in err and value in err and "is not a port" in err, err


def test_an_unknown_log_level_is_a_usage_error_listing_the_levels(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "LOUD", "validate", "-f", "x.yaml"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--log-level: invalid choice: 'LOUD'" in err and "'WARNING'" in err


def test_a_log_level_in_lower_case_is_taken(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "debug", "--version"])
    assert exit_info.value.code == 0
