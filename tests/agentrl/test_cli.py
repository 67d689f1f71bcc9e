from agentrl.cli import SUBCOMMANDS, build_parser


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    for name in SUBCOMMANDS:
        try:
            parser.parse_args([name, "--help"])
        except SystemExit as exc:
            assert exc.code == 0
        out = capsys.readouterr().out
        assert f"agentrl {name}" in out
