"""The launch side: what the `trl-gspo` command and the recipes use, beside the trainer's modules (as TRL keeps
`trl/scripts/` beside `trl/trainer/`).

- `cli`: the `trl-gspo` command; validates a recipe, then launches `train` by module name (never imports it).
- `train`: the launched entry point (`python -m trl_gspo.launch.train`, `accelerate launch -m trl_gspo.launch.train`).
- `recipe`: a recipe's YAML and command-line keys parsed into TRL's dataclasses, the built-in models and datasets,
  the `accelerate launch` options, the summary of a run.
- `checks`: what a parsed recipe must satisfy (values, dataset, tools, launcher), as `RecipeError`s.
- `effective`: what the run does once the launcher applied its settings (precision, processes, ZeRO, batch).
- `rewards`, `tool_registry`: rewards, tools and environments named in a recipe.
- `launching`, `multinode`: the launcher's process tree and signals (and `accelerate launch` with `quiet`'s filters);
  several nodes.
- `quiet`: the third-party warnings a run cannot act on, filtered by their exact text.
- `reporting`: the end-of-run summary and training curves.
"""

import time as _time

# When this process began its run: the first import of the launch package, at the top of `trl-gspo` and of a launched
# process. Not the process's own start time: under `bash -c "pip install ... && trl-gspo ..."` bash hands its own
# process, started before pip, to the last command.
STARTED = _time.time()
