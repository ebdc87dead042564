"""`python -m kvpipe` and the `kvpipe` command: the command line, with a Ctrl-C while it starts
(importing it) or after its command the same one line and exit code as during the command."""
import sys


def main(argv: list[str] | None = None) -> int:
    try:   # `import kvpipe` imports nothing more (kvpipe/__init__.py): the whole start is in here
        from kvpipe.cli import main as cli_main
        return cli_main(argv)
    except KeyboardInterrupt as e:   # outside cli's own guard: its imports, its parser
        from kvpipe.stopping import interrupted
        return interrupted(e)


if __name__ == "__main__":
    code = main()
    exec("")   # under -m CPython ends by SIGINT if a KeyboardInterrupt once left an exec (a dataclass's): this clears it
    sys.exit(code)
