"""The command line's options: each documented, the benchmarks alike, counts in e-notation,
init-deployment's --offline (issue 27, item 7)."""

from __future__ import annotations

import argparse

import pytest

from common.service_config import load_config, write_scratch_deployment
from starfish.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, path=()):
    yield path, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _commands(sub, path + (name,))


PARSER = build_parser()
BENCHES = {path[1]: p for path, p in _commands(PARSER) if len(path) == 2 and path[0] == "bench"}


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings}


def test_every_option_and_positional_has_help():
    missing = [f"starfish {' '.join(path)} {a.option_strings or a.dest}"
               for path, p in _commands(PARSER) for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert not missing, missing


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_benchmarks_share_quiet_and_where_linked_lan_and_offline(name):
    opts = _options(BENCHES[name])
    assert "--quiet" in opts
    if "--profile" in opts:
        assert "lan" in str(opts["--profile"].default).split(","), opts["--profile"].default
        # a bench comparing modes takes a list (tests/bench/test_common_options.py checks each)
        assert opts["--offline"].default == "dealer"
        assert set(opts["--offline"].choices or ("dealer", "two-party")) == {"dealer", "two-party"}


def test_scaling_takes_counts_in_e_notation_and_the_profile_spelling():
    args = PARSER.parse_args(["bench", "scaling", "--base-params", "1e3", "--small-params", "2e4",
                              "--profile", "none"])
    assert (args.base_params, args.small_params, args.profiles) == (1000, 20000, ["none"])
    with pytest.raises(SystemExit):
        PARSER.parse_args(["bench", "scaling", "--base-params", "1.5"])


def test_init_deployment_is_two_party_by_default_and_dealer_on_request(tmp_path, capsys):
    """Issue 26: nothing beyond the two servers unless the operator asks for a dealer."""
    assert main(["init-deployment", str(tmp_path / "d"), "--clients", "2"]) == 0
    assert load_config(tmp_path / "d" / "config.toml").offline == "two-party"
    out = capsys.readouterr().out
    assert "starfish dealer" not in out and "offline = \"two-party\"" in out
    assert main(["init-deployment", str(tmp_path / "d")]) == 2      # refuses an existing deployment
    assert "refusing" in capsys.readouterr().err
    assert main(["init-deployment", str(tmp_path / "e"), "--clients", "2", "--offline", "dealer"]) == 0
    assert load_config(tmp_path / "e" / "config.toml").offline == "dealer"
    assert "starfish dealer --config" in capsys.readouterr().out


def test_a_config_that_names_no_mode_is_two_party(tmp_path):
    path = write_scratch_deployment(tmp_path / "d", clients=2)
    text = path.read_text()
    assert 'offline = "two-party"' in text
    path.write_text(text.replace('offline = "two-party"\n', ""))
    assert "offline" not in path.read_text()
    assert load_config(path).offline == "two-party"
    demo = PARSER.parse_args(["demo"])
    assert demo.offline == "two-party"
