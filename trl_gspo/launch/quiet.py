"""Third-party warnings a trl-gspo run cannot act on, filtered by their exact text in the processes trl-gspo runs
(the command, the `accelerate launch` it starts, the training processes); every other warning, TRL's and ours
included, is printed as before. `install()` is idempotent.

- transformers (5.23 and later) warns that `gradient_checkpointing` is deprecated each time a `TrainingArguments` is
  built with it set, and TRL's configs always set it (default True): 3 to 5 times a run. A recipe cannot use the new
  name, `activation_checkpointing`, which older transformers releases in the supported range lack.
- TRL's trainer reads `model.is_gradient_checkpointing`, which warns the same way.
- DeepSpeed (0.19) calls `torch.distributed.all_gather_into_tensor` and `reduce_scatter_tensor`, which torch 2.13
  deprecates: one warning of each per optimizer step and process under ZeRO-3 (the code that calls them is
  DeepSpeed's).
- `accelerate launch` lists the options it filled with defaults (on a CPU "`--num_processes` was set to a value of
  `0`": it runs one process). Only the lines of defaults that change nothing are dropped: one machine, no mixed
  precision at launch (the training config sets it), no dynamo, 0 or 1 processes. Any other line (several GPUs found,
  CPU threads per process) is still printed.
"""

from __future__ import annotations

import logging
import re
import warnings

# (message regex, matched from the start of the warning's text; category)
FILTERED_WARNINGS = (
    (r"`gradient_checkpointing` is deprecated and will be removed in v6\. Use `activation_checkpointing` instead\.",
     FutureWarning),
    (r"`is_gradient_checkpointing` is deprecated and will be removed in v6\. Use `is_activation_checkpointing` "
     r"instead\.", FutureWarning),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated\. Please use `torch\.distributed\.all_gather_single` "
     r"instead\.", FutureWarning),
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated\. Please use "
     r"`torch\.distributed\.reduce_scatter_single` instead\.", FutureWarning),
)

ACCELERATE_DEFAULTS_HEADER = ("The following values were not passed to `accelerate launch` and had defaults used "
                              "instead:")
ACCELERATE_DEFAULTS_FOOTER = "To avoid this warning pass in values"
# The lines of that message whose defaults change nothing for a trl-gspo launch.
HARMLESS_DEFAULTS = re.compile(r"\s*`--(num_processes` was set to a value of `[01]|num_machines` was set to a value of "
                               r"`1|mixed_precision` was set to a value of `'no'|dynamo_backend` was set to a value of "
                               r"`'no')`\s*$")
ACCELERATE_LAUNCH_LOGGER = "accelerate.commands.launch"


class AccelerateDefaultsFilter(logging.Filter):
    """Drops the harmless lines of `accelerate launch`'s "values were not passed" warning, and the warning when no
    other line is left."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(ACCELERATE_DEFAULTS_HEADER):
            return True
        lines = message.splitlines()
        kept = [line for line in lines[1:] if not line.startswith(ACCELERATE_DEFAULTS_FOOTER)
                and not HARMLESS_DEFAULTS.match(line)]
        if not kept:
            return False
        record.msg, record.args = "\n".join([lines[0], *kept, *(line for line in lines[1:]
                                                                if line.startswith(ACCELERATE_DEFAULTS_FOOTER))]), None
        return True


_FILTER = AccelerateDefaultsFilter()


def install() -> None:
    """Filter the warnings above in this process."""
    for message, category in FILTERED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    logger = logging.getLogger(ACCELERATE_LAUNCH_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
