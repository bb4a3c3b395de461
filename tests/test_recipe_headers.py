"""A recipe's header says what its own file sets, and carries no measured figure.

Every recipe under recipes/ (launcher configs in recipes/accelerate/ aside) is resolved as `trl-gspo --config RECIPE
--dry_run true` resolves it: `parse_recipe` as the command calls it, then `check_recipe`, with a GPU present (bf16
recipes as written) and the hub probes answered offline. Each claim of its header (the card of .ci/recipe_table.py
and the prose under it) is then checked against the resolved values:

- the loss the What line names (GSPO-token, GSPO, GRPO): `loss_type`;
- a clip band written out ("clip 0.2 / 0.27", "eps 3e-4 / 4e-4", "[1-3e-4, 1+4e-4]"): `epsilon`, `epsilon_high`;
  "the paper's band" / "the paper's clip range" / "paper presets": 3e-4 / 4e-4 with `clip_band` "fixed"; the band set
  by the run: `clip_band` "adaptive" (both as the config resolves them: `AsyncGSPOConfig` for `trainer: async`);
  "no KL": `beta` 0; "N mini-batches": `steps_per_generation`; "token-level": `importance_sampling_level`;
- routing replay: R2 `routing_replay` "old", R3 "sampler", "without replay" / "no routing replay" "none";
- LoRA named in the What line if and only if `use_peft`;
- the vLLM mode the What line names (colocate, server) and "sleep mode"; "TP N" (x "DP M") and "tensor parallel N":
  `vllm_tensor_parallel_size` in colocate mode, the header's own `trl-gspo vllm-serve` command in server mode, whose
  `--model` and `--port` are the recipe's;
- the launch: the processes the card and prose count, the launcher the card names (ZeRO-3, its CPU offload, FSDP2,
  "no DeepSpeed"), the header's own commands (`--config` names this recipe, `--config_file` and `--num_processes`
  are the recipe's), "N processes x B x G accumulation steps", "N completions per optimizer step";
- a key written with a number (`vllm_gpu_memory_utilization 0.6`, `max_staleness 2`, `vllm_server_timeout, 240 s`):
  that key's value;
- no measured figure: no date, no commit id, no "measured" (bar "not measured"), no "number -> number". Measured
  figures live in docs/results.md; a header links the section that holds them (`docs/results.md#<anchor>`, whose
  anchor must be a heading there). "Ran on a GPU: yes" links docs/results.md.

Each mismatch is reported with the recipe, the claim and the resolved value."""

import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from support.recipe_headers import header_commands
from test_links import anchors

from trl_gspo.launch.checks import check_recipe
from trl_gspo.launch.effective import Launcher
from trl_gspo.launch.effective import resolve as resolve_settings
from trl_gspo.launch.recipe import launch_options, launched_processes, launcher_type, parse_recipe

ROOT = Path(__file__).resolve().parents[1]


def _recipe_table():
    """.ci/recipe_table.py, imported by path (.ci is not a package)."""
    spec = importlib.util.spec_from_file_location("recipe_table", ROOT / ".ci" / "recipe_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECIPE_TABLE = _recipe_table()
RECIPES = RECIPE_TABLE.recipes()
NUMBER = r"\d+(?:\.\d+)?(?:e-?\d+)?"
PAPER_BAND = (3e-4, 4e-4)
LOSS_NAMES = {"GSPO-token": "gspo_token", "GSPO": "gspo", "GRPO": "grpo"}
WORDS = {"one": 1, "two": 2}

# Measured figures, with their provenance, belong in docs/results.md. A link into the docs is not one, unless it names
# a dated heading: no date may stand in a header.
DOCS_LINK = re.compile(r"\bdocs/[\w./-]+\.md#[\w-]+")
MEASURED = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.? "
                         r"20\d\d\b", re.IGNORECASE),
    "a commit id": re.compile(r"\bcommit [0-9a-f]{7,40}\b"),
    "'measured'": re.compile(r"(?<!\bnot )\bmeasured\b", re.IGNORECASE),
    "a measured change (number -> number)": re.compile(rf"{NUMBER}%?\s*->\s*~?{NUMBER}"),
}


@dataclass
class Resolved:
    script: object
    args: object  # GSPOConfig, or AsyncGSPOConfig for `trainer: async`
    model: object
    launch: list

    @property
    def asynchronous(self) -> bool:
        return self.script.trainer == "async"

    @property
    def processes(self) -> int:
        return launched_processes(self.launch)

    @property
    def config_file(self) -> Path | None:
        options, _ = launch_options(self.launch)
        return Path(options.config_file).resolve() if options.config_file else None

    @property
    def vllm_mode(self) -> str | None:
        """How the recipe samples with vLLM: "colocate", "server" (the asynchronous trainer always samples from a
        server), or None (transformers' generate)."""
        if self.asynchronous:
            return "server"
        return self.args.vllm_mode if self.args.use_vllm else None


def resolve(recipe: Path, monkeypatch, fake_accelerator) -> Resolved:
    """The recipe as `trl-gspo --config RECIPE --dry_run true` resolves it on a GPU machine without the hub."""
    fake_accelerator(True)
    if importlib.util.find_spec("vllm") is None:  # R3 in colocate mode asks for an installed vLLM's version
        from trl_gspo.sampling import engine

        monkeypatch.setattr(engine, "installed_vllm_version", lambda: engine.VLLM_RANGE[0])
    monkeypatch.setattr("trl_gspo.launch.checks._probe_dataset", lambda key, path, config: None)
    monkeypatch.setattr("trl_gspo.launch.checks._probe_model", lambda key, name: None)  # hub model, offline
    script, args, model, dataset, launch, _ = parse_recipe(["--config", str(recipe)], before_launch=True)
    check_recipe(script, args, model, dataset, launch)
    return Resolved(script, args, model, launch)


def header_lines(path: Path) -> list[str]:
    """The comment lines that open the recipe, without their `#`."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return lines


def _option(command: str, name: str) -> str | None:
    match = re.search(rf"(?:^|\s){re.escape(name)}[ =](\S+)", command)
    return match.group(1) if match else None


def _close(value, claimed: float) -> bool:
    return value is not None and math.isclose(float(value), claimed, rel_tol=1e-9)


def _field(resolved: Resolved, name: str):
    """(found, value) of a key of the resolved recipe."""
    for part in (resolved.args, resolved.script, resolved.model):
        if hasattr(part, name):
            return True, getattr(part, name)
    return False, None


def problems(name: str, path: Path, resolved: Resolved) -> list[str]:
    """Every claim of the header of the recipe at `path` (shipped as `name`) that its resolved values contradict,
    and every measured figure in it."""
    lines = header_lines(path)
    text = re.sub(r"\s+", " ", " ".join(line.strip() for line in lines))
    card = RECIPE_TABLE.card(path)
    what, sized = card["What"], card["Sized for"]
    args, found = resolved.args, []

    def check(claim: str, holds: bool, value: str) -> None:
        if not holds:
            found.append(f"{name}: the header says {claim!r}, but the recipe resolves to {value}")

    # The loss the What line names.
    named = {LOSS_NAMES[m] for m in re.findall(r"\bGSPO-token\b|\bGSPO\b(?!-)|\bGRPO\b", what)}
    check(f"What: {what}", named == {args.loss_type},
          f"loss_type={args.loss_type!r} (the What line names {sorted(named) or 'no loss'})")
    if re.search(r"\btoken-level (?:GRPO|ratio)", text, re.IGNORECASE) and hasattr(args, "importance_sampling_level"):
        check("token-level", args.importance_sampling_level == "token",
              f"importance_sampling_level={args.importance_sampling_level!r}")

    # The clip band.
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    band = f"epsilon={args.epsilon}, epsilon_high={high}, clip_band={getattr(args, 'clip_band', None)!r}"
    written = [*re.finditer(rf"\b(?:clip|eps|epsilon)\s+({NUMBER})\s*/\s*({NUMBER})", text),
               *re.finditer(rf"\[1\s*-\s*({NUMBER}),\s*1\s*\+\s*({NUMBER})\]", text)]
    for match in written:
        check(match.group(0), _close(args.epsilon, float(match.group(1))) and _close(high, float(match.group(2))), band)
    for match in re.finditer(r"\bpaper'?s (?:clip )?band\b|\bpaper'?s clip range\b|\bpaper'?s? presets\b", text):
        check(match.group(0), _close(args.epsilon, PAPER_BAND[0]) and _close(high, PAPER_BAND[1])
              and getattr(args, "clip_band", "fixed") == "fixed", band)
    adaptive = re.search(r"\bband set by the run\b|\bclip_band:? adaptive\b", text)
    if adaptive:
        check(adaptive.group(0), getattr(args, "clip_band", None) == "adaptive", band)
    elif getattr(args, "clip_band", None) == "adaptive":
        found.append(f"{name}: the header does not say the band is set by the run, but the recipe resolves to {band}")
    if re.search(r"\bno KL\b|\bbeta 0\b", text) and hasattr(args, "beta"):
        check("no KL", args.beta == 0, f"beta={args.beta}")
    for match in re.finditer(r"\b(\d+) mini-batches\b", text):
        if not resolved.asynchronous:
            check(match.group(0), args.steps_per_generation == int(match.group(1)) * args.gradient_accumulation_steps,
                  f"steps_per_generation={args.steps_per_generation}, "
                  f"gradient_accumulation_steps={args.gradient_accumulation_steps}")

    # Routing replay.
    replay = getattr(args, "routing_replay", "none")
    claimed = {value for pattern, value in ((r"\bR2\b", "old"), (r"\bR3\b", "sampler"),
                                            (r"\bwithout (?:routing )?replay\b|\bno routing replay\b", "none"))
               if re.search(pattern, what, re.IGNORECASE)}
    if claimed:
        check(f"What: {what}", claimed == {replay}, f"routing_replay={replay!r}")
    elif replay != "none":
        found.append(f"{name}: the What line names no routing replay, but the recipe resolves to "
                     f"routing_replay={replay!r}")
    negative = re.search(r"\b(?:no|without) routing replay\b|\bdoes not replay\b", text, re.IGNORECASE)
    if negative:
        check(negative.group(0), replay == "none", f"routing_replay={replay!r}")

    # LoRA.
    check(f"What: {what}", bool(re.search(r"\bLoRA\b", what)) == bool(resolved.model.use_peft),
          f"use_peft={resolved.model.use_peft}")

    # vLLM: the mode, sleep mode, tensor and data parallel sizes, the server's command.
    mode = resolved.vllm_mode
    modes = {value for pattern, value in ((r"\bcolocate\b|\bvLLM in(?:side)? the training process", "colocate"),
                                          (r"\bserver\b", "server")) if re.search(pattern, what)}
    check(f"What: {what}", modes == ({mode} if mode else set()),
          f"{'vllm_mode=' + repr(mode) if mode else 'use_vllm=False'} (the What line names "
          f"{sorted(modes) or 'no vLLM mode'})")
    if "sleep mode" in what:
        check("sleep mode", bool(getattr(args, "vllm_enable_sleep_mode", False)),
              f"vllm_enable_sleep_mode={getattr(args, 'vllm_enable_sleep_mode', None)}")
    serve = [command for command in header_commands(path) if "vllm-serve" in command]
    if mode == "server":
        if not serve:
            found.append(f"{name}: the recipe samples from a vLLM server, but the header has no `trl-gspo vllm-serve` "
                         "command")
        if resolved.asynchronous:
            port = urlparse(args.vllm_server_base_url).port
        else:
            port = args.vllm_server_port
        for command in serve:
            check(command, _option(command, "--model") == resolved.model.model_name_or_path,
                  f"model_name_or_path={resolved.model.model_name_or_path!r}")
            check(command, _option(command, "--port") in (None, str(port)), f"the server's port {port}")
    tensor = {"colocate": [getattr(args, "vllm_tensor_parallel_size", None)],
              "server": [int(_option(command, "--tensor-parallel-size") or 1) for command in serve]}.get(mode, [])
    data = [int(_option(command, "--data-parallel-size") or 1) for command in serve] if mode == "server" else []
    card_tp = re.search(r"\bTP (\d+)(?: x DP (\d+))?", f"{what} {sized}")
    if mode and not card_tp:
        found.append(f"{name}: the recipe samples with vLLM ({mode}), but the card names no tensor parallel size "
                     f"(TP N); it resolves to {tensor}")
    claims = [(m.group(0), int(m.group(1)), None if m.group(2) is None else int(m.group(2)))
              for m in ([card_tp] if card_tp else [])]
    claims += [(m.group(0), int(m.group(1)), None) for m in re.finditer(r"\btensor parallel (\d+)", text)]
    claims += [(m.group(0), None, int(m.group(1))) for m in re.finditer(r"\bdata parallel (\d+)", text)]
    source = "vllm_tensor_parallel_size" if mode == "colocate" else "the header's vllm-serve command"
    for claim, tp, dp in claims:
        if tp is not None:
            check(claim, bool(tensor) and all(size == tp for size in tensor),
                  f"tensor parallel {tensor or 'none'} ({source})")
        if dp is not None:
            check(claim, bool(data) and all(size == dp for size in data),
                  f"data parallel {data or 'none'} (the header's vllm-serve command)")

    # The launch: processes, launcher, the header's own commands.
    processes = resolved.processes
    count = (re.search(r"\((\d+) processes\b", sized) or re.search(r"\b(\d+|one) trains?\b", sized)
             or re.match(r"(\d+)x? (?:H\d+|GPU)", sized))
    if count:
        number = WORDS.get(count.group(1)) or int(count.group(1))
        check(f"Sized for: {sized}", number == processes, f"{processes} training process(es)")
    for match in re.finditer(r"\b(\d+|one) (?:training )?process(?:es)?\b", text):
        check(match.group(0), (WORDS.get(match.group(1)) or int(match.group(1))) == processes,
              f"{processes} training process(es)")
    for match in re.finditer(r"\b(\d+) processes x (\d+) x (\d+) accumulation steps", text):
        check(match.group(0), (int(match.group(2)), int(match.group(3))) == (
            args.per_device_train_batch_size, args.gradient_accumulation_steps),
            f"per_device_train_batch_size={args.per_device_train_batch_size}, "
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}")
    for match in re.finditer(r"\b(\d+) completions per optimizer step", text):
        total = processes * args.per_device_train_batch_size * args.gradient_accumulation_steps
        check(match.group(0), int(match.group(1)) == total, f"{total} completions per optimizer step ({processes} "
              f"processes x {args.per_device_train_batch_size} x {args.gradient_accumulation_steps})")
    config_file, kind = resolved.config_file, launcher_type(resolved.launch)
    where = f"launcher {kind}, accelerate config {config_file.name if config_file else None}"
    # The layout and precision the card and the Hardware line claim: what the run does once the launcher applies its
    # settings (trl_gspo/launch/effective.py), not the recipe's own keys alone.
    settings = resolve_settings(args, resolved.model, Launcher.from_launch_args(resolved.launch))
    launcher = settings.launcher
    where += f" (ZeRO stage {launcher.zero_stage}, offloaded: {', '.join(launcher.offload) or 'nothing'})"
    if "ZeRO-3" in sized:
        offload = "offload" in sized
        check(f"Sized for: {sized}", launcher.zero_stage == 3 and bool(launcher.offload) == offload, where)
    if "FSDP2" in sized:
        check(f"Sized for: {sized}", kind == "FSDP" and config_file is not None
              and yaml.safe_load(config_file.read_text()).get("fsdp_config", {}).get("fsdp_version") == 2, where)
    trains = "float32" if settings.precision == "no" else settings.precision
    claimed = " ".join([sized, *(line for line in lines if line.strip().startswith("Hardware:"))])
    for word in sorted(set(re.findall(r"\b(float32|bf16|fp16)\b(?! weights)", claimed))):
        check(word, trains == word, f"training in {trains} ({settings.precision_from})")
    if re.search(r"\bno DeepSpeed\b", text):
        check("no DeepSpeed", kind != "DEEPSPEED", where)
    for command in header_commands(path):
        config = _option(command, "--config")
        if config and "--config" in command and "vllm-serve" not in command:
            check(command, config == name, f"the recipe {name}")
        if command.split()[:1] == ["accelerate"] or " accelerate launch " in f" {command} ":
            given = _option(command, "--config_file")
            check(command, (None if given is None else (ROOT / given).resolve()) == config_file,
                  f"accelerate config {config_file}")
            given = _option(command, "--num_processes")
            check(command, given is None or int(given) == processes, f"{processes} training process(es)")

    # A key written with a number: that key's value.
    for match in re.finditer(rf"(?<![-\w`])`?([a-z]+(?:_[a-z0-9]+)+)`?,? ({NUMBER})\b", text):
        known, value = _field(resolved, match.group(1))
        if known and isinstance(value, (int, float)) and not isinstance(value, bool):
            check(match.group(0), _close(value, float(match.group(2))), f"{match.group(1)}={value}")

    # No measured figure; links into the docs name a heading there.
    for kind_of, pattern in MEASURED.items():
        # A link's words ("#measured-in-...") are no figure; a date is one even in a link (a dated heading).
        bare = text if kind_of == "a date" else DOCS_LINK.sub("<link>", text)
        for match in pattern.finditer(bare):
            context = bare[max(0, match.start() - 50):match.end() + 30]
            found.append(f"{name}: the header carries {kind_of}, {match.group(0)!r} in '...{context}...': measured "
                         "figures live in docs/results.md; link the section that holds it")
    for match in DOCS_LINK.finditer(text):
        page, anchor = match.group(0).split("#")
        if not (ROOT / page).is_file() or anchor not in anchors(ROOT / page):
            found.append(f"{name}: the header links {match.group(0)}, which is no heading of {page}")
    if card["Ran on a GPU"].startswith("yes"):
        check(f"Ran on a GPU: {card['Ran on a GPU']}", "docs/results.md" in card["Ran on a GPU"],
              "no link to docs/results.md, where GPU runs are written up")
    return found


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.relative_to(ROOT / "recipes").as_posix() for p in RECIPES])
def test_the_header_says_what_its_recipe_sets(recipe, monkeypatch, fake_accelerator):
    name = recipe.relative_to(ROOT).as_posix()
    found = problems(name, recipe, resolve(recipe, monkeypatch, fake_accelerator))
    assert not found, f"{len(found)} header claim(s) the recipe contradicts:\n" + "\n".join(found)


def test_a_wrong_header_is_reported(tmp_path, monkeypatch, fake_accelerator):
    """The checks above can fail: a header that misnames the loss, the band, the replay and LoRA, or carries a
    measured figure, is reported claim by claim."""
    recipe = ROOT / "recipes" / "granite_3b_a800m" / "gspo.yaml"
    name = recipe.relative_to(ROOT).as_posix()
    resolved = resolve(recipe, monkeypatch, fake_accelerator)
    text = recipe.read_text()
    wrong = (text.replace("# What: GSPO on", "# What: GRPO + R2 with LoRA (clip 0.2 / 0.27) on", 1)
             .replace("#\n", "#\n# 12 GiB, measured on 2026-01-01 at commit 97ce408f; reward 0.5 -> 0.9.\n", 1)
             .replace("trl-gspo --config recipes/granite_3b_a800m/gspo.yaml",
                      "trl-gspo --config recipes/granite_3b_a800m/grpo.yaml"))
    copy = tmp_path / "gspo.yaml"
    copy.write_text(wrong)
    found = "\n".join(problems(name, copy, resolved))
    for needle in ["loss_type='gspo'", "epsilon=0.0003, epsilon_high=0.0004", "routing_replay='none'",
                   "use_peft=False", "a date", "a commit id", "'measured'", "number -> number",
                   f"the recipe {name}"]:
        assert needle in found, f"{needle!r} not reported:\n{found}"


def test_a_header_precision_the_launcher_overrides_is_reported(tmp_path, monkeypatch, fake_accelerator):
    """The asynchronous recipe's header says float32; launched with fsdp2.yaml (mixed_precision bf16) it would train
    bf16 (transformers takes the launcher's precision when bf16 is false): the check reads the launcher, and says so."""
    recipe = ROOT / "recipes" / "qwen3_30b_a3b" / "async" / "gspo.yaml"
    name = recipe.relative_to(ROOT).as_posix()
    copy = tmp_path / "gspo.yaml"
    copy.write_text(recipe.read_text().replace("../../accelerate/fsdp2_fp32.yaml",
                                               str(ROOT / "recipes" / "accelerate" / "fsdp2.yaml")))
    found = problems(name, copy, resolve(copy, monkeypatch, fake_accelerator))
    assert any("'float32'" in problem and "training in bf16" in problem for problem in found), found
