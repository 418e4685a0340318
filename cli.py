"""What the command lines (train.py and scripts/) share: the --help layout, the device `--device auto` picks,
--push-to-hub, --tokenizer, and one error line for bad input."""
import argparse
import sys

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


def add_push_to_hub(parser, what):
    """The --push-to-hub option of a tool that writes `what` (the merged folder, the GGUF file)."""
    parser.add_argument("--push-to-hub", metavar="REPO", default=None,
                        help=f"then upload {what}, with a model card, to this hub model repo (user/name), created if "
                             "needed; needs `hf auth login` or HF_TOKEN")


def add_tokenizer(parser):
    """The --tokenizer option: another tokenizer than --model's own."""
    parser.add_argument("--tokenizer", metavar="FOLDER", default=None,
                        help="take the tokenizer and chat template from this model folder (or .gguf file) instead "
                             "of --model's")


def run_tool(main):
    """Run a script's main(): bad input (ValueError, FileNotFoundError; ImportError: an optional package that
    is not installed) is one `error: ...` line and exit status 2, no traceback."""
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
