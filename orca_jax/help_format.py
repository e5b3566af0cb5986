"""The help format of the command-line entry points: descriptions as written, every flag's default."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """A description as written (its examples keep their lines), and each flag's default after its help;
    a switch's (off) and a default of None are left out: None's help says what it means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)
