"""A weight transfer for TRL's asynchronous trainer on a CPU, through a file and vLLM's `/collective_rpc`, test-only.

What it replaces: TRL 1.16's `trl.experimental.async_grpo.weight_transfer.WeightTransferClient`, the default
`weight_transfer` of `AsyncGRPOTrainer`. That client streams the trainer's parameters into the vLLM server over NCCL
(vLLM's NCCL weight-transfer engine: `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, with the trainer as rank 0 of a process group that spans both sides). NCCL needs CUDA
devices on both ends, so on a CPU machine the trainer cannot build the group and no weight ever reaches the server.
A GPU needs nothing from this module: there, TRL's own client works as shipped.

Here the same `WeightTransferProtocol` (`init_weight_transfer`, `pause`, `send_weights`, `resume`, `destroy`) is
implemented over HTTP against a vLLM server started in dev mode (`VLLM_SERVER_DEV_MODE=1`, which `trl vllm-serve`
sets) with `--worker-extension-cls support.async_weight_files.LoadWeightsFile`:

- `pause`: `POST /pause?mode=keep` (what TRL's client does: in-flight requests freeze and go on after `resume`);
- `send_weights`: the `(name, tensor)` stream TRL hands over (transformers names, from `_iter_vllm_named_params`) is
  written to one safetensors file in a scratch directory, then `POST /collective_rpc` calls
  `LoadWeightsFile.load_weights_file(path)` on every worker of the server: the engine model's own `load_weights`
  reads the file, then the CPU MoE experts are packed again (`vllm_cpu_engine.repack_experts`: vLLM's CPU build
  packs expert weights into its kernel's layout at load time and a later `load_weights` writes plain ones, which the
  kernel would read as packed; tests/support/vllm_cpu_engine.py, loaded as a vLLM plugin in every server process, tracks
  the packed layers). Then `POST /reset_prefix_cache`, so that no new request reuses KV blocks computed with the old
  weights (the reset is refused by vLLM while frozen requests still hold blocks; `prefix_cache_resets` counts both);
- `resume`: `POST /resume`.

vLLM 0.29's Qwen3-MoE `load_weights` accepts transformers 5's names as they are, the fused expert tensors
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) included: no renaming here (checked by the transfer test: the
server's log-probs equal the trainer's after each transfer).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import requests
import torch

# for `--worker-extension-cls` (tests/ is on the server's PYTHONPATH)
WORKER_EXTENSION = "support.async_weight_files.LoadWeightsFile"


class FileWeightTransfer:
    """Trainer side: `AsyncGRPOTrainer(..., weight_transfer=FileWeightTransfer(url))`.

    `skip_after`: forward only the first `skip_after` transfers and drop the later ones (read the stream, send
    nothing), a broken transfer for negative controls; None forwards every transfer. `log` lists every transfer:
    seconds to write, to load on the server, tensors, what each worker reported."""

    def __init__(self, server_url: str, timeout: float = 300.0, skip_after: int | None = None):
        self.server_url = server_url.rstrip("/")
        self.timeout = timeout
        self.skip_after = skip_after
        self.log: list[dict] = []
        self.prefix_cache_resets = {"done": 0, "refused": 0}
        self._directory: str | None = None

    def _post(self, path: str, **kwargs) -> requests.Response:
        response = requests.post(f"{self.server_url}{path}", timeout=self.timeout, **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"POST {path} to the vLLM server at {self.server_url}: {response.status_code} "
                               f"{response.text[:2000]}")
        return response

    def init_weight_transfer(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if requests.get(f"{self.server_url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM server at {self.server_url} did not answer /health")
            time.sleep(1)
        self._directory = tempfile.mkdtemp(prefix="trl-gspo-weights-")

    def pause(self) -> None:
        self._post("/pause", params={"mode": "keep"})

    def send_weights(self, iterator) -> None:
        started = time.monotonic()
        if self.skip_after is not None and len(self.log) >= self.skip_after:
            for _ in iterator:  # TRL's stream (a gather per parameter under FSDP) is read as it would be
                pass
            self.log.append({"sent": False, "tensors": 0, "write_s": time.monotonic() - started})
            return
        from safetensors.torch import save_file

        # every tensor its own copy: safetensors refuses tensors that share storage (tied embeddings)
        tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in iterator}
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix="trl-gspo-weights-")
        path = os.path.join(self._directory, f"weights-{len(self.log)}.safetensors")
        save_file(tensors, path)
        written = time.monotonic()
        answer = self._post("/collective_rpc", json={"method": "load_weights_file", "args": [path]}).json()
        loaded = time.monotonic()
        os.remove(path)
        reset = self._post("/reset_prefix_cache").json()
        self.prefix_cache_resets["done" if reset.get("success") else "refused"] += 1
        workers = answer.get("results", [])
        for worker in workers:
            if worker["not_loaded"]:
                raise RuntimeError(f"a vLLM worker's model did not load these parameters from the {len(tensors)} "
                                   f"tensors sent: {worker['not_loaded']}")
        self.log.append({"sent": True, "tensors": len(tensors), "write_s": written - started,
                         "load_s": loaded - written, "workers": workers})

    def resume(self) -> None:
        self._post("/resume")

    def destroy(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


class LoadWeightsFile:
    """Server side: mixed into each vLLM worker by
    `--worker-extension-cls support.async_weight_files.LoadWeightsFile`."""

    @torch.no_grad()
    def load_weights_file(self, path: str) -> dict:
        """Load a safetensors file of transformers-named weights into this worker's model; returns what it did:
        `tensors` read, `not_loaded` (the engine's parameters that `load_weights` did not report loaded: vLLM fuses
        several checkpoint tensors into one parameter, so names are compared on the engine's side), `repacked` (CPU
        MoE layers whose experts were packed again)."""
        from safetensors.torch import load_file

        from support import vllm_cpu_engine

        model = self.get_model()
        weights = load_file(path)
        loaded = model.load_weights(iter(weights.items()))
        # vLLM 0.29 reports the expert tensors it loaded as `...mlp.experts.w13_weight` (the name inside its
        # `routed_experts` module, under the layer's prefix); the parameter is `...experts.routed_experts.w13_weight`
        names = {name.replace(".routed_experts.", ".") for name, _ in model.named_parameters()}
        not_loaded = sorted(names - set(loaded or ()))
        repacked = vllm_cpu_engine.repack_experts()
        return {"tensors": len(weights), "not_loaded": not_loaded, "repacked": repacked}
