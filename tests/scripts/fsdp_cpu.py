"""Test-only: run `trl-gspo` under an accelerate FSDP2 config on the CPU (one process, gloo), to shake out FSDP bugs on
a machine without a GPU. Never for real training: accelerate itself has no FSDP on CPU, so this patches it here.

    python tests/scripts/fsdp_cpu.py cli --config recipes/quickstart.yaml --use_cpu false \
        --accelerate_config recipes/accelerate/fsdp2.yaml --num_processes 1 [...]

What is patched, and only in the processes this script starts:
  cli     trl-gspo's "FSDP needs a GPU" launch check sees an accelerator, and it launches `accelerate launch` through
          this script (`launch`), with this script (`train`) as the training script instead of
          `-m trl_gspo.launch.train`.
  launch  nothing: accelerate's own launcher (torchrun, one worker).
  train   accelerate's backend choice: a torchrun worker on the CPU gets (gloo, MULTI_GPU) on device `cpu`, which
          AcceleratorState upgrades to FSDP as it would on a GPU; then `trl_gspo.launch.train.main` runs unchanged, its
          own check_distributed_setup included (it sees what it sees on a GPU: MULTI_GPU in PartialState).
"""

import os
import sys

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)


def cli(argv):
    import trl_gspo.launch.launching
    import trl_gspo.launch.checks

    trl_gspo.launch.checks.has_accelerator = lambda: True

    def launch_command(tokens):
        index = tokens.index("--module")
        tokens = tokens[:index] + [HERE, "train"] + tokens[index + 2:]
        return [sys.executable, HERE, "launch", *tokens]

    trl_gspo.launch.launching.accelerate_launch_command = launch_command
    from trl_gspo.launch.cli import main

    return main(argv)


def launch(argv):
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command(launch_command_parser().parse_args(argv))
    return 0


def train(argv):
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if int(os.environ.get("LOCAL_RANK", -1)) != -1 and os.environ.get("ACCELERATE_USE_FSDP") == "true":
            return "gloo", DistributedType.MULTI_GPU
        return original(self, cpu, sagemaker_dp, backend)

    PartialState._prepare_backend = prepare_backend
    import trl_gspo.trainer

    trainer_train = trl_gspo.trainer.GSPOTrainer.train

    def train_and_report(self, *args, **kwargs):  # one line showing that FSDP2 did shard the model
        result = trainer_train(self, *args, **kwargs)
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        print(f"[fsdp_cpu] distributed_type {self.accelerator.distributed_type.value}, fsdp_version "
              f"{getattr(plugin, 'fsdp_version', None)}, is_fsdp_enabled {self.is_fsdp_enabled}, FSDP modules "
              f"{sum(isinstance(m, FSDPModule) for m in self.model.modules())}, DTensor parameters "
              f"{sum(isinstance(p, DTensor) for p in self.model.parameters())}/{len(list(self.model.parameters()))}",
              flush=True)
        return result

    trl_gspo.trainer.GSPOTrainer.train = train_and_report
    from trl_gspo.launch.train import main

    return main(argv)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    raise SystemExit({"cli": cli, "launch": launch, "train": train}[mode](rest))
