"""The `motor` command line (console script `motor` = `python -m motor`).

`main(argv=None) -> int` parses the command line and runs one command; `console()` (the
console script, `python -m motor`) calls it and exits.  A usage error
prints ONE line `motor: error: ...` on stderr and exits 2.  Commands live in modules:
`serve` (motor.cli.serve) and the client commands (motor.cli.commands); exit statuses of
`run`/`attach` are the pure function `exit_status` (motor.cli.outcome).
"""

from __future__ import annotations

import argparse
import os
import sys

from motor.cli.outcome import exit_status

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Sequence

__all__ = ["main", "console", "build_parser", "exit_status", "Parser", "Formatter", "UsageError"]


class UsageError(Exception):
    """Raised by a command for a bad argument found after parsing: one line, exit 2."""


def require_text(values) -> None:
    """UsageError for the first `(what, value)` whose value is not UTF-8 (bytes a shell
    passed, held as surrogates): the runner's API is JSON and the task queue's rows are
    text (before stop 60 the client died with a traceback of UnicodeEncodeError)."""
    for what, value in values:
        if value is None:
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"{what} {os.fsencode(value)!r} is not UTF-8: motor's API carries "
                             "text, so commands, names and values must be UTF-8") from None


class Formatter(argparse.HelpFormatter):
    """argparse's help formatter, sized as shutil.get_terminal_size would size it without
    importing shutil (argparse makes a formatter for every add_argument: shutil, bz2 and
    lzma cost about 2 ms of every command's start-up)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None):
        if width is None:
            width = _terminal_columns() - 2
        super().__init__(prog, indent_increment, max_help_position, width)


def _terminal_columns() -> int:
    """shutil.get_terminal_size().columns: $COLUMNS, else the terminal's, else 80."""
    import os

    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        message = " ".join(str(message).split())
        sys.stderr.write(f"motor: error: {message}\n")
        sys.stderr.flush()
        raise SystemExit(2)


#: command -> the module that registers it; `main` builds only that module's subcommands,
#: so a client command never imports `serve` (motor.config, msgspec) or `task` (msgspec)
COMMAND_MODULES = {
    "serve": "serve",
    **dict.fromkeys(("run", "submit", "attach", "cancel", "withdraw", "status", "jobs", "health",
                     "workspaces"), "commands"),
    "task": "tasks",
    "worker": "tasks",
}


def build_parser(only: str | None = None, command: str | None = None) -> Parser:
    """The whole command line; `only="commands"` (a module of COMMAND_MODULES) registers just
    that module's subcommands, and with `command` (one of the client commands) only that one:
    what `main` does once it knows the command."""
    import importlib

    parser = Parser(
        prog="motor",
        description="motor: a build-job runner for shared build hosts.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name in ("serve", "commands", "tasks"):
        if only is None or only == name:
            module = importlib.import_module(f"motor.cli.{name}")
            if name == "commands" and command is not None:
                module.register(sub, only=command)
            else:
                module.register(sub)
    return parser


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Split at the first `--`: options before it, the job's command after it."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, None


def _messages_untranslated(environ=os.environ) -> bool:
    """Whether gettext would hand every message back as it is: the language it takes (the
    first of LANGUAGE, LC_ALL, LC_MESSAGES, LANG that is set, its first entry) is the C
    locale (unset, `C`, `POSIX`, `C.UTF-8`, ...), which has no catalog (for `C.UTF-8`
    Python's gettext still looks for one under that name; no distribution ships one)."""
    for name in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        if value := environ.get(name):
            language = value.split(":")[0].split(".")[0].split("@")[0]
            return language in ("", "C", "POSIX")
    return True


def _cache_argparse_translations() -> None:
    """argparse looks every message up with gettext, and each look-up searches the locale
    directories again (a dozen stat calls; about half of building a parser). The answer
    cannot change within one process: remember it. In the C locale (services and CI jobs
    mostly run in it) every answer is the message itself, so argparse is given that
    without asking: gettext's first look-up imports `locale`, 2 ms of a CLI start."""
    import functools
    import gettext

    untranslated = _messages_untranslated()
    if getattr(argparse, "_", None) is gettext.gettext:
        argparse._ = str if untranslated else functools.lru_cache(maxsize=None)(gettext.gettext)
    if getattr(argparse, "ngettext", None) is gettext.ngettext:
        argparse.ngettext = (_plural if untranslated
                             else functools.lru_cache(maxsize=None)(gettext.ngettext))


def _plural(singular: str, plural: str, n: int) -> str:
    """gettext.ngettext without a catalog."""
    return singular if n == 1 else plural


def main(argv: Sequence[str] | None = None) -> int:
    _cache_argparse_translations()
    argv = list(sys.argv[1:] if argv is None else argv)
    front, tail = _split_command(argv)
    # the command is the first word (the top level has no options but --help)
    command = front[0] if front and front[0] in COMMAND_MODULES else None
    parser = build_parser(COMMAND_MODULES.get(command), command)
    args = parser.parse_args(front)
    args.tail = tail
    handler = getattr(args, "handler", None)
    if handler is None:  # pragma: no cover - required=True prevents it
        parser.error("no command given")
    if tail is not None and not getattr(args, "takes_command", False):
        parser.error(f"{args.command} takes no command after --")
    try:
        return int(handler(args) or 0)
    except UsageError as exc:
        parser.error(str(exc))
        return 2  # not reached
    except KeyboardInterrupt:
        sys.stderr.write("motor: interrupted\n")
        return 130


def console() -> None:
    """The `motor` console script and `python -m motor`: `main()`, then the exit. A client
    command (motor.cli.commands: `run`, `submit`, `status`, ...) leaves at once when its
    output is flushed (`os._exit`): its process holds nothing to tear down (one socket, no
    file open for writing, no thread but a daemon timer), and the interpreter's own
    finalization (every module's objects freed, one by one) is 4-6 ms of every `motor
    run` (docs/cli.md, "Start-up cost"). `serve`, `task` and `worker` exit as Python does."""
    argv = sys.argv[1:]
    code = main(argv)
    front, _ = _split_command(argv)
    if not (front and COMMAND_MODULES.get(front[0]) == "commands"):
        raise SystemExit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (a broken pipe) or a closed stream
            pass
    os._exit(code)
