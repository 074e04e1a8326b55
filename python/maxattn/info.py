"""``python -m maxattn.info``: prints what this install can run (see ``maxattn.show_config``)."""

from maxattn._src.info import show_config


def main() -> int:
    show_config()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
