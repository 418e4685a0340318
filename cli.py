"""What the command lines (train.py and scripts/) share: the --help layout and the device `--device auto` picks."""
import argparse

import torch


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the line breaks of the description (the module docstring, with its examples) and ends each
    option's help with its default. An option whose default is None says in its own help what happens then."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def auto_device() -> str:
    """What --device auto picks: an NVIDIA GPU (cuda), else Apple silicon (mps), else the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"
