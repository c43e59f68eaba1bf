"""`shmcoll-run`: start the ranks of one job, here or on the hosts of a hostfile, and exit with its status.

Parsing stops at PROGRAM, so the program's own options (even `-n`) are passed through untouched.
"""

from __future__ import annotations

import argparse
import sys

from shmcoll.errors import InvalidArgument
from shmcoll.launch.argtypes import int_in, number_above
from shmcoll.launch.hostfile import read_hostfile
from shmcoll.launch.local import launch_local
from shmcoll.launch.multihost import launch_hosts

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shmcoll-run", allow_abbrev=False,
        description="Start N ranks of PROGRAM on this host (-n N), or on the hosts of a hostfile "
                    "(--hostfile FILE), with the SHMCOLL_* environment set; exit with the first "
                    "failing rank's status after stopping the others.")
    p.add_argument("-n", "--np", dest="n", type=int_in(1), default=None, metavar="N",
                   help="number of ranks (>= 1); with --hostfile, the first N slots (default: all)")
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="run on these hosts: lines 'HOST [slots=K]', '#' starts a comment")
    p.add_argument("--rsh", default="ssh", metavar="CMD",
                   help="with --hostfile: how to run a command on a host, as 'CMD HOST COMMAND...' "
                        "(default: ssh; for example 'ip netns exec')")
    p.add_argument("--master-addr", default=None, metavar="ADDR",
                   help="with --hostfile: rendezvous address (default: the host of rank 0)")
    p.add_argument("--master-port", type=int_in(1, 65535), default=None, metavar="PORT",
                   help="rendezvous port (default: a free one)")
    p.add_argument("-x", dest="export", action="append", default=[], metavar="NAME[=VALUE]",
                   help="with --hostfile: also pass this variable to remote ranks (repeatable)")
    p.add_argument("--tag-output", action="store_true",
                   help="prefix every line of the ranks' output with [rank]")
    p.add_argument("--timeout", type=number_above(0.0, False), default=None, metavar="SECONDS",
                   help="stop every rank and exit 124 if the job runs longer than this")
    p.add_argument("program", metavar="PROGRAM [ARGS...]", nargs="?",
                   help="executable, or a .py file run with this Python, and its arguments")
    return p


def split_argv(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, PROGRAM and its args): the split is at the first token that is neither an
    option nor an option's value, or after a `--`. argparse's REMAINDER would eat a `--` meant for
    the program, so the program's part never goes through argparse.
    """
    takes_value = {s for a in parser._actions if a.option_strings and a.nargs is None
                   for s in a.option_strings}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1:]
        if not token.startswith("-") or token == "-":
            break
        i += 2 if token in takes_value else 1
    return argv[:i], argv[i:]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parsed options plus `.command`; SystemExit (2 on a usage error, 0 for --help) like argparse."""
    parser = build_parser()
    options, command = split_argv(parser, argv)
    args = parser.parse_args(options)
    if not command:
        parser.error("PROGRAM is required")
    if args.hostfile is None:
        if args.n is None:
            parser.error("-n N is required without --hostfile")
        given = [opt for opt, value in (("--rsh", args.rsh != "ssh"), ("--master-addr", args.master_addr),
                                        ("-x", args.export)) if value]
        if given:
            parser.error(f"{', '.join(given)} only apply with --hostfile")
    args.command = command
    return args


def run(args: argparse.Namespace) -> int:
    """Dispatch on the launch mode: this host only, or the hosts of a hostfile."""
    if args.hostfile is None:
        return launch_local(args.n, args.command, master_port=args.master_port, timeout=args.timeout,
                            tag_output=args.tag_output)
    try:
        hosts = read_hostfile(args.hostfile)
        return launch_hosts(hosts, args.command, n=args.n, rsh=args.rsh, master_addr=args.master_addr,
                            master_port=args.master_port, timeout=args.timeout,
                            tag_output=args.tag_output, export=args.export)
    except InvalidArgument as e:  # a bad hostfile or too many ranks for it: a usage error
        print(f"shmcoll-run: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # usage error or --help: report its status instead of exiting
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
