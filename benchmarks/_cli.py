"""Command lines: the parser and the options the benchmarks share, and what every run
sets up before it measures (quiet warnings).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path

from _report import REPO, RESULTS

WAIT_IDLE_HELP = (
    "before each timed phase wait up to this many seconds for other processes to\n"
    "use < 10%% of the CPU; default 0 (do not wait; contention is reported anyway)"
)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the script's docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)


def add_root(p: argparse.ArgumentParser, help: str, default: Path | None = None) -> None:
    """``--root``: the scratch directory (default: ``bench_out/`` in the repo)."""
    p.add_argument("--root", type=Path, default=default or REPO / "bench_out", help=help)


def add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None, help="also write the raw samples here")


def _optional_path(value: str) -> Path | None:
    return Path(value) if value else None


def add_results(p: argparse.ArgumentParser, name: str) -> None:
    """``--results``: the results file (``_report.Results``) the docs' tables are built
    from; default ``benchmarks/results/<name>.json``, ``''`` to write none."""
    p.add_argument(
        "--results",
        type=_optional_path,
        default=RESULTS / f"{name}.json",
        help=f"write the results file here (default benchmarks/results/{name}.json;\n"
        "'' for none): command, commit, date, machine, every sample",
    )


def args_record(args: argparse.Namespace) -> dict[str, object]:
    """The parsed options as JSON values (paths as strings), for a results file."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def add_wait_idle(p: argparse.ArgumentParser, help: str = WAIT_IDLE_HELP) -> None:
    p.add_argument("--wait-idle", type=float, default=0.0, help=help)


def names(
    p: argparse.ArgumentParser,
    value: str,
    known: Sequence[str],
    what: str,
    *,
    families: bool = False,
    required: bool = False,
) -> list[str]:
    """The comma-separated names in ``value``, each one of ``known`` (else ``p.error``).

    ``families``: a name may also be a prefix before ``-`` of known names (``minilm``
    selects ``minilm-fp32`` and ``minilm-bf16``). ``required``: at least one name.
    """
    out: list[str] = []
    for v in (v.strip() for v in value.split(",")):
        hits = [k for k in known if k == v or (families and k.startswith(v + "-"))]
        if v and not hits:
            p.error(f"unknown {what} {v!r}; choose from {', '.join(known)}")
        out += [h for h in hits if h not in out]
    if required and not out:
        p.error(f"no {what} given; choose from {', '.join(known)}")
    return out


def quiet_dcp_warnings() -> None:
    """Silence the warning ``dcp.save``/``dcp.load`` give once per call without a process
    group: there is nothing to act on in a one-process benchmark."""
    warnings.filterwarnings("ignore", message=".*process group.*")
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
