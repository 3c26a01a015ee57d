"""``python -m dcp_multilevel``: the command-line tool (see ``dcp_multilevel/cli/``)."""

from dcp_multilevel.cli import main

if __name__ == "__main__":
    main(prog_name="dcp-multilevel")
