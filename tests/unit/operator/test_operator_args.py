"""The operator's command line: each bad combination stops it at start with a message naming the
flag and what it must be (argparse exit 2), never a replica that runs misconfigured."""

from __future__ import annotations

import pytest

from spectrain_operator.__main__ import parse_args


@pytest.mark.parametrize(("argv", "message"), [
    (["-A", "-n", "team-a"], "--all-namespaces and --namespace exclude each other"),
    (["--leader-elect"], "--leader-elect needs --lease-namespace"),
    (["--lease-duration", "2"], "--lease-duration must be at least 3 s, not 2"),
    (["--qps", "-5"], "--qps must be 0 (unlimited) or positive, not -5.0"),
    (["--qps", "10", "--burst", "0"], "--burst must be at least 1 with --qps 10.0"),
])
def test_a_bad_command_line_names_the_flag(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SPECTRAIN_OPERATOR_NAMESPACE", raising=False)
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_good_command_lines_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECTRAIN_OPERATOR_NAMESPACE", raising=False)
    args = parse_args(["--leader-elect", "--lease-namespace", "ops", "--qps", "0", "--burst", "0"])
    assert args.leader_elect and args.lease_namespace == "ops" and args.qps == 0
