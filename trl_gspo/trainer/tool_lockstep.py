"""TRL's tool loop on several processes: every rank takes part in every tool turn and gets its own results back.

TRL 1.16's `_tool_call_loop` runs on each rank with that rank's tool-calling samples only, and each tool turn calls
`_generate_single_turn` with them. Where generating is a collective, that breaks in two ways (read in TRL 1.16,
measured in tests/test_tool_turns.py):

    vLLM server mode, > 1 process    TRL gathers every rank's prompts, the main process generates them all, and each
                                     rank keeps `process_index * len(prompts)` onwards of the results: with unequal
                                     counts (the usual case in a tool turn) a rank receives another rank's completions
    vLLM colocate, TP > 1            the same within a tensor-parallel group (`all_gather_object`, slice by rank)
    HF generate under ZeRO-3 / FSDP  generate gathers parameters and steps in sync across ranks (`synced_gpus`)

and in every one of them a rank whose samples stop calling tools leaves the loop while another rank goes on into a
collective: a hang, or collectives paired with the wrong partner. Layouts that generate locally (DDP, ZeRO-1/2, vLLM
colocate at TP 1) are left as TRL runs them.

`ToolTurnsMixin` (a base of `GSPOTrainer`) fixes both in these layouts, the narrowest way found:

1. Before each tool turn, the ranks exchange how many samples each sends (one small all-gather). The turn happens while
   any rank has samples; a rank whose own loop has ended takes part with an empty turn.
2. vLLM server / TP: the group's prompts are sent to TRL's generate from the group's first rank only (the others send
   none), so TRL's slice hands that rank every result and the others nothing; it then scatters them back by the
   counts each rank sent. TRL's engine call, sampling parameters and weight sync stay TRL's own.
3. HF generate under ZeRO-3 / FSDP: a rank with no samples runs a one-token generate so that its parameter gathers and
   `synced_gpus` steps meet the other ranks'.

`trl_tool_loop_needs_lockstep()` says which TRL versions need it: the ones read and measured here (docs/tool_turns.md). A TRL
outside that range runs its own loop unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["TRL_VERSIONS_NEEDING_LOCKSTEP", "ToolTurnsMixin", "lockstep_layout", "trl_tool_loop_needs_lockstep"]

#: TRL versions whose tool loop slices or skips collectives per rank (read in 1.16.0's code, measured with it).
TRL_VERSIONS_NEEDING_LOCKSTEP = SpecifierSet(">=1.16.0,<1.17")


def trl_tool_loop_needs_lockstep(version: str | None = None) -> bool:
    """Does this TRL (default: the installed one) need `ToolTurnsMixin` on several processes?"""
    if version is None:
        import trl

        version = trl.__version__
    return Version(version).base_version in TRL_VERSIONS_NEEDING_LOCKSTEP


def lockstep_layout(trainer) -> str | None:
    """"server", "tensor_parallel" or "collective_generate" where TRL's tool turns must run in lockstep; else None."""
    accelerator = trainer.accelerator
    if accelerator.num_processes == 1 or not trl_tool_loop_needs_lockstep():
        return None
    if trainer.use_vllm:
        if trainer.vllm_mode == "server":
            return "server"
        return "tensor_parallel" if trainer.vllm_generation.tensor_parallel_size > 1 else None
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    zero3 = plugin is not None and plugin.zero_stage == 3
    fsdp = str(accelerator.distributed_type).endswith("FSDP")
    return "collective_generate" if zero3 or fsdp else None


@dataclass
class TurnSplit:
    """How one lockstep tool turn was generated: `counts[i]` samples from the group's i-th rank, this rank the
    `index`-th. The group's results are laid out in that order (vLLM route capture reads it)."""

    counts: list[int]
    index: int

    @property
    def start(self) -> int:
        return sum(self.counts[:self.index])


class ToolTurnsMixin:
    """Overrides `_tool_call_loop` and `_generate_single_turn` of TRL's `GRPOTrainer` (module docstring)."""

    _lockstep: str | None = None  # `lockstep_layout` while TRL's tool loop runs in lockstep; None otherwise
    _exchanged: list[int] | None = None  # the counts the empty-turn driver below already exchanged for its turn
    _turn_split: TurnSplit | None = None  # the last lockstep vLLM turn's layout, for the route capture

    def _tool_call_loop(self, *args, **kwargs):
        layout = lockstep_layout(self)
        if layout is None:
            return super()._tool_call_loop(*args, **kwargs)
        self._lockstep = layout  # inside the loop: `_generate_single_turn` calls are tool turns
        try:
            result = super()._tool_call_loop(*args, **kwargs)
            # This rank's loop has ended; others may still have tool calls: take part in their turns, empty-handed.
            while any(counts := self._exchange_counts(0)):
                self._exchanged = counts
                self._generate_single_turn([], None, {}, num_generations=1)
        finally:
            self._lockstep, self._exchanged = None, None
        return result

    def _exchange_counts(self, count: int) -> list[int]:
        """Every rank's number of samples in this turn (one all-gather; every rank calls it once per turn)."""
        counts = self.accelerator.gather(torch.tensor([count], device=self.accelerator.device))
        return [int(c) for c in counts.cpu()]

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self._turn_split = None
        if self._lockstep is None:  # not a tool turn, or a layout that generates locally
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        # A tool turn of this rank's own loop exchanges its count here; an empty turn of the driver above did already
        counts = self._exchanged if self._exchanged is not None else self._exchange_counts(len(prompt_ids))
        self._exchanged = None
        if multimodal_fields:
            raise NotImplementedError(
                "tools with image inputs on several processes: GSPOTrainer keeps TRL's tool turns in lockstep across "
                "ranks for this layout and does not pass multimodal fields between them. Fix: train on one process, "
                "or with DDP / ZeRO-1/2 and HF generate, or vLLM colocate at tensor-parallel size 1.")
        if self._lockstep == "collective_generate":
            return self._hf_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        return self._vllm_turn(counts, prompt_ids, images, num_generations, has_tool_images)

    def _hf_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        if prompt_ids:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        # Empty-handed: one one-token prompt, one new token; `synced_gpus` keeps this rank stepping with the others.
        config = self.generation_config
        saved = (config.max_new_tokens, config.min_new_tokens)
        config.max_new_tokens, config.min_new_tokens = 1, None
        try:
            token = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
            super()._generate_single_turn([[token]], None, {}, 1, False)
        finally:
            config.max_new_tokens, config.min_new_tokens = saved
        return [], None

    def _vllm_turn(self, counts, prompt_ids, images, num_generations, has_tool_images):
        group, ranks = self._generation_group()
        rank = dist.get_rank()
        split = TurnSplit([counts[r] for r in ranks], ranks.index(rank))
        if not any(split.counts):  # another TP group's turn: this group has nothing to generate
            return [], None
        leader = ranks[0]
        gathered = [None] * len(ranks) if rank == leader else None
        dist.gather_object((list(prompt_ids), images), gathered, dst=leader, group=group)
        if rank == leader:
            prompt_ids = [ids for part, _ in gathered for ids in part]
            images = ([image for part, part_images in gathered for image in (part_images or [None] * len(part))]
                      if any(part_images is not None for _, part_images in gathered) else None)
        else:
            prompt_ids, images = [], None
        self._turn_split = split
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, {}, num_generations,
                                                                 has_tool_images)
        parts = None
        if rank == leader:  # this rank holds every result of the group: hand each rank back its own, in order
            parts, start = [], 0
            for count in split.counts:
                parts.append((completion_ids[start:start + count],
                              None if logprobs is None else logprobs[start:start + count]))
                start += count
        received = [None]
        dist.scatter_object_list(received, parts, src=leader, group=group)
        return received[0]

    def _generation_group(self):
        """The process group that shares one vLLM generate call, and its global ranks in order."""
        if self.vllm_mode == "server":
            return None, list(range(dist.get_world_size()))
        group = self.vllm_generation.tp_group
        return group, sorted(dist.get_process_group_ranks(group))

