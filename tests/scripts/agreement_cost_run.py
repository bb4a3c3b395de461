"""What the ranks' agreement costs when nothing fails (benchmarks/rank_agreement_cost.py): on two processes under
`accelerate launch` (DDP, or real DeepSpeed ZeRO over gloo), GSPOTrainer in server mode as tests/scripts/fault_run.py
builds it (TRL's own `VLLMGeneration` and `DistributedBackend` against the stand-in server, no fault), trained in two
arms in the same processes, one after another:

- `agreement`: as shipped: the server sync wrapped by `agreed_server_sync`, the trainer's phases and store watch on
  (`RanksStopTogether`);
- `plain`: TRL's `VLLMGeneration.sync_weights` as is (`agreed_server_sync` not called), `server_guards` guarding
  nothing, `RanksStopTogether`'s methods passing straight through to the next class, `RankWatch.start` returning
  None (trl_gspo/ranks/phases.py).

    accelerate launch --config_file recipes/accelerate/cpu_zero3.yaml --num_processes 2 agreement_cost_run.py OUT \
        [--steps 3] [--grad-accum 2] [--repeats 2]

Counted on each rank, from the trainer's `on_train_begin` to its `on_train_end` (a "setup" window before, DeepSpeed's
engine built, is counted apart): every call of a `torch.distributed` collective (patched in `torch.distributed` and
`torch.distributed.distributed_c10d` before DeepSpeed, accelerate or TRL are imported, and in any module that bound
one by name; a collective called inside another, such as `all_gather_object`'s own `all_gather`, counts once, as the
outer call), and every host read of a tensor's values (`Tensor.item`, `.tolist`, `.cpu`, `.numpy`, and `bool()`,
`int()`, `float()`, `__index__` of a tensor): on a GPU each is a device-to-host sync; on a CPU they are only counted.
Collectives that C++ issues by itself (DDP's bucketed gradient all-reduce in its Reducer) are not seen here: they are
the same in both arms.

Each event is filed under the innermost region it happened in: `sync` (the generation object's `sync_weights`),
`rollout` (`_generate_and_score_completions`, less its sync), `micro-batch` (`training_step`, less its rollout; under
DeepSpeed the optimizer step runs inside the last micro-batch's backward), `save` (`_save_checkpoint`), `other`;
and under its call site (the first four frames outside torch and this file, RanksStopTogether's own methods left
out so that a site of both arms has one name). Each rank writes OUT/rank<r>.json."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "monitored_barrier", "recv",
    "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "send_object_list", "_all_gather_base", "_reduce_scatter_base",
    "_broadcast_coalesced",  # a C binding DDP calls from Python (its broadcast of module states and buffers)
)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
HERE = os.path.abspath(__file__)
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
PASSED = ("train", "_calculate_rewards", "_generate_and_score_completions", "_save_checkpoint")  # RanksStopTogether's


class Recorder:
    """Events of the main thread and any other, filed by (window, region, kind, name, site)."""

    def __init__(self):
        self.counts = None  # a Counter while recording
        self.window = "setup"
        self.regions: list[str] = []
        self.local = threading.local()  # the depth of collectives in progress on this thread

    def site(self) -> str:
        frame, frames = sys._getframe(2), []
        while frame is not None and len(frames) < 4:
            name = frame.f_code.co_filename
            if name != HERE and not name.startswith(TORCH_DIR) and not (
                    name == PHASES and frame.f_code.co_name in PASSED):  # the arms' sites match without them
                frames.append(f"{_short(name)}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        return " < ".join(frames)

    def record(self, kind: str, name: str) -> None:
        if self.counts is None:
            return
        region = self.regions[-1] if self.regions and threading.current_thread() is threading.main_thread() else (
            "other" if threading.current_thread() is threading.main_thread() else "thread")
        self.counts[(self.window, region, kind, name, self.site())] += 1

    @contextlib.contextmanager
    def region(self, name: str):
        self.regions.append(name)
        try:
            yield
        finally:
            self.regions.pop()


RECORDER = Recorder()


def _short(path: str) -> str:
    for marker in ("site-packages/", str(Path(HERE).parents[2]) + "/"):  # the repository's root, wherever it lies
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _counting_collective(name, original):
    def collective(*args, **kwargs):
        depth = getattr(RECORDER.local, "depth", 0)
        if depth == 0:
            RECORDER.record("collective", name)
        RECORDER.local.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            RECORDER.local.depth = depth
    collective.__wrapped__, collective.__name__, collective._counted = original, name, True
    return collective


def _counting_read(name, original):
    def read(self, *args, **kwargs):
        RECORDER.record("host_read", name)
        return original(self, *args, **kwargs)
    read.__name__ = name
    return read


ORIGINALS: dict[int, object] = {}  # id(original function) -> its counting wrapper


def install() -> None:
    """Before DeepSpeed, accelerate and TRL are imported: their `from torch.distributed import ...` bind the
    wrappers. `sweep` later replaces any original a module bound before this ran."""
    for name in COLLECTIVES:
        for module in (c10d, dist):
            original = getattr(module, name, None)
            if original is None or getattr(original, "_counted", False):
                continue
            wrapper = ORIGINALS.get(id(original)) or _counting_collective(name, original)
            ORIGINALS[id(original)] = wrapper
            setattr(module, name, wrapper)
    for name in HOST_READS:
        setattr(torch.Tensor, name, _counting_read(name, getattr(torch.Tensor, name)))


def sweep() -> list[str]:
    """Module globals still naming an original collective (bound by name before `install`): replaced."""
    replaced = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if module_name.startswith("torch._C") or not isinstance(namespace, dict):  # the bindings themselves
            continue
        for key, value in list(namespace.items()):
            wrapper = ORIGINALS.get(id(value)) if callable(value) else None
            if wrapper is not None and wrapper is not value and getattr(wrapper, "__wrapped__", None) is value:
                namespace[key] = wrapper
                replaced.append(f"{module_name}.{key}")
    return replaced


install()

sys.path.insert(0, str(Path(HERE).parent))
import fault_run  # noqa: E402

try:  # skip DeepSpeed's 60-80 s JIT build of a shared-memory op that gloo on CPU does not need
    import deepspeed.ops  # noqa: E402

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
except ImportError:
    pass

from trl_gspo.ranks import phases as rank_phases  # noqa: E402
from trl_gspo.ranks import watch as rank_watch  # noqa: E402
import trl_gspo.trainer.gspo_trainer as gspo_trainer_module  # noqa: E402

RanksStopTogether = rank_phases.RanksStopTogether
PHASES = rank_phases.__file__


class NoFault:
    """fault_run's `Cell` with no fault: nothing fires on any rank."""

    fault, rank_of_fault, trainer, here = "none", -1, "gspo-server", False

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def fire(self, what):
        raise AssertionError(f"no fault fires here: {what}")


@contextlib.contextmanager
def plain_arm():
    """TRL's trainer without the agreement: `agreed_server_sync` does nothing (fault_run.serve imports it when
    called), so the sync is TRL's `VLLMGeneration.sync_weights` as is; `server_guards` (GSPOTrainer's guard of the
    main process's generate request, where there is one) guards nothing; RanksStopTogether's methods pass through;
    no watch is started."""
    saved = {name: RanksStopTogether.__dict__[name] for name in PASSED}

    def passing(name):
        def method(self, *args, **kwargs):
            return getattr(super(RanksStopTogether, self), name)(*args, **kwargs)
        return method

    modules = [rank_phases, gspo_trainer_module]
    replaced = {(m, name): m.__dict__[name] for m in modules for name in ("agreed_server_sync", "server_guards")
                if name in m.__dict__}
    start = rank_watch.RankWatch.__dict__["start"]
    for module, name in replaced:
        setattr(module, name, (lambda trainer: None) if name == "agreed_server_sync" else
                (lambda trainer: contextlib.ExitStack()))
    rank_watch.RankWatch.start = classmethod(lambda cls, *args, **kwargs: None)
    for name in saved:
        setattr(RanksStopTogether, name, passing(name))
    try:
        yield
    finally:
        for (module, name), original in replaced.items():
            setattr(module, name, original)
        rank_watch.RankWatch.start = start
        for name, method in saved.items():
            setattr(RanksStopTogether, name, method)


def in_region(name, method, calls):
    def call(*args, **kwargs):
        if RECORDER.window == "steps":
            calls[name] += 1
        with RECORDER.region(name):
            return method(*args, **kwargs)
    return call


def train_arm(arm: str, repeat: int, options) -> dict:
    from transformers import TrainerCallback

    out = options.out_dir / f"{arm}-{repeat}"
    cell = NoFault(out)
    with plain_arm() if arm == "plain" else contextlib.nullcontext():
        trainer = fault_run.gspo_trainer(cell, cell.dir / "run", with_server=True)
        generation = trainer.vllm_generation
        shipped = getattr(generation.sync_weights, "__qualname__", "")
        assert ("agreed_server_sync" in shipped) == (arm == "agreement"), shipped
        calls = collections.Counter()
        generation.sync_weights = in_region("sync", generation.sync_weights, calls)
        for name, method in (("rollout", "_generate_and_score_completions"), ("micro-batch", "training_step"),
                             ("save", "_save_checkpoint")):
            setattr(trainer, method, in_region(name, getattr(trainer, method), calls))

        class Window(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                RECORDER.window = "steps"

            def on_train_end(self, args, state, control, **kwargs):
                RECORDER.window = "teardown"

        trainer.add_callback(Window())
        swept = sweep()
        RECORDER.counts, RECORDER.window = collections.Counter(), "setup"
        start = time.monotonic()
        try:
            trainer.train()
        finally:
            counts, RECORDER.counts = RECORDER.counts, None
        seconds = time.monotonic() - start
    return {"arm": arm, "repeat": repeat, "steps": trainer.state.global_step, "syncs": calls["sync"],
            "micro_batches": calls["micro-batch"], "rollouts": calls["rollout"], "saves": calls["save"],
            "server_syncs": getattr(getattr(generation, "vllm_client", None), "syncs", None),
            "seconds": seconds, "swept": swept,
            "events": [[*key, count] for key, count in sorted(counts.items())]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=2,
                        help="micro-batches per optimizer step (steps_per_generation follows: one rollout and one "
                             "weight sync per step)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arms", default="agreement,plain")
    options = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    tiny_config = fault_run.tiny_config

    def config(out, **overrides):  # fault_run's config, with the number of steps and micro-batches set here
        # and a bound on the phases no busy machine reaches (fault_run's 8 s is for its hanging reward function;
        # the bound is read only by the watch thread, which makes no collective and reads no tensor)
        overrides.update(max_steps=options.steps, gradient_accumulation_steps=options.grad_accum,
                         steps_per_generation=options.grad_accum, rank_wait_timeout=600)
        return tiny_config(out, **overrides)
    fault_run.tiny_config = config
    runs = []
    for repeat in range(options.repeats):  # arms interleaved: a first-run effect shows as repeats that differ
        for arm in options.arms.split(","):
            runs.append(train_arm(arm, repeat, options))
    options.out_dir.mkdir(parents=True, exist_ok=True)
    (options.out_dir / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "runs": runs}))


if __name__ == "__main__":
    main()
